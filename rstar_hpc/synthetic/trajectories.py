"""Synthetic, paper-shaped trajectories for tests and bench/exchange.py (no model needed).

Shape follows rStar2-Agent RL (paper §2-§4): a ~200-token prompt; alternating assistant turns (reasoning +
a Hermes <tool_call>) and tool turns (<tool_response> with mask 0), ending with an <answer>; a few thousand
response tokens; tool results with every status the sandbox reports.
"""
from __future__ import annotations

import json

import numpy as np

from rstar_hpc.exchange.schema import Timings, ToolCall, Trajectory, Turn
from rstar_hpc.exchange.tool_status import TOOL_STATUSES

_WORDS = "so the sum of the roots is then we check with python since the integer count equals".split()


def make_step(run: str, stage: str, step: int, num_prompts: int, samples_per_prompt: int, *, mean_tokens: int = 3000,
              engine_rank: int = 0, seed: int = 0, text: bool = True) -> list[Trajectory]:
    rng = np.random.default_rng([seed, step, engine_rank])
    return [make_trajectory(rng, run, stage, step, f"p{step}-{engine_rank}-{p}", s, mean_tokens=mean_tokens,
                            engine_rank=engine_rank, text=text)
            for p in range(num_prompts) for s in range(samples_per_prompt)]


def make_trajectory(rng: np.random.Generator, run: str, stage: str, step: int, uid: str, sample_index: int, *,
                    mean_tokens: int = 3000, engine_rank: int = 0, text: bool = True) -> Trajectory:
    total = max(8, int(rng.normal(mean_tokens, mean_tokens / 4)))
    num_tools = int(rng.integers(0, 5))
    # split the response into 2*num_tools+1 spans: assistant, tool, assistant, ..., assistant
    cuts = np.sort(rng.choice(np.arange(1, total), size=2 * num_tools, replace=False)) if num_tools else []
    bounds = [0, *[int(c) for c in cuts], total]
    turns, calls = [], []
    mask = np.ones(total, dtype=np.uint8)
    for i in range(len(bounds) - 1):
        role = "assistant" if i % 2 == 0 else "tool"
        start, end = bounds[i], bounds[i + 1]
        if role == "tool":
            mask[start:end] = 0
            status = str(rng.choice(TOOL_STATUSES, p=[.6, .15, .05, .04, .06, .03, .03, .03, .005, .005]))
            out = f"Tool call {'success' if status == 'ok' else 'failure'}\nstdout: {int(rng.integers(1e6))}"
            calls.append(ToolCall(turn=len(turns) - 1, name="python_code_with_standard_io",
                                  arguments=json.dumps({"code": "print(sum(range(10)))", "input": ""}),
                                  status=status, wall_time_s=_f32(rng.gamma(2, 0.2)), output=out,
                                  output_chars=len(out) + int(rng.integers(0, 2000) if status == "output_truncated" else 0)))
        turns.append(Turn(role, start, end, _text(rng, end - start, role, i == len(bounds) - 2) if text else ""))
    logprobs = np.where(mask == 1, -rng.exponential(0.3, total), 0.0).astype(np.float32)
    reward = float(rng.random() < 0.5)
    errors = sum(c.is_error for c in calls)
    return Trajectory(
        run=run, stage=stage, step=step, prompt_uid=uid, sample_index=sample_index, policy_version=max(step - 1, 0),
        engine_rank=engine_rank, prompt_ids=rng.integers(0, 151_000, 200, dtype=np.int32),
        response_ids=rng.integers(0, 151_000, total, dtype=np.int32), loss_mask=mask, logprobs=logprobs, turns=turns,
        prompt_text="You must put your answer inside <answer> </answer> tags.\nThis is the problem:\nFind x." if text else "",
        tool_calls=calls, finish_reason="stop" if reward else str(rng.choice(["stop", "length", "max_turns"])),
        answer="42" if reward else None, reward=reward, p_err=_f32(errors / len(calls)) if calls else 0.5,
        p_format=0.0,
        timings=Timings(queue_s=_f32(0.1), generate_s=_f32(total / 1000), tool_s=_f32(sum(c.wall_time_s for c in calls)),
                        reward_s=_f32(0.05), total_s=_f32(total / 1000 + 0.2)))


def _f32(x: float) -> float:
    return float(np.float32(x))   # the schema stores float32; keep round trips exact


def _text(rng: np.random.Generator, ntokens: int, role: str, last: bool) -> str:
    words = " ".join(rng.choice(_WORDS, size=min(ntokens, 400)))
    if role == "tool":
        return "<tool_response>\nTool call success\nstdout: 45\n</tool_response>"
    if last:
        return f"<reason>{words}</reason>\n<answer>\\boxed{{42}}</answer>"
    return (f"<reason>{words}</reason>\n<tool_call>{{\"name\": \"python_code_with_standard_io\", "
            f"\"arguments\": {{\"code\": \"print(sum(range(10)))\", \"input\": \"\"}}}}</tool_call>")
