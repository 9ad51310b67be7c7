"""Test doubles for the agent loop: a scripted engine, scripted tools and the turns they write (the agent tests,
the levers' and the tool sessions' use them; test_e2e runs vLLM instead)."""
from __future__ import annotations

import asyncio

from rstar_hpc.config.rollout import AgentConfig
from rstar_hpc.models.chat_format import IM_END, render_tool_call
from rstar_hpc.rollout.agent import AgentLoop, Generation


class ScriptedEngine:
    """Answers turn k of a request with script[k] (text), logprob -0.5 - 0.001*i per token; records contexts."""

    def __init__(self, tok, scripts: dict[str, list[str]], delay_s: float = 0.0):
        self.tok, self.scripts, self.delay_s = tok, scripts, delay_s
        self.calls: list[tuple[str, list[int], int, float]] = []
        self.seeds: list[int | None] = []

    async def generate(self, prompt_ids, max_tokens, request_id, *, seed=None):
        traj, turn = request_id.rsplit("-t", 1)
        self.seeds.append(seed)
        self.calls.append((request_id, list(prompt_ids), max_tokens, asyncio.get_running_loop().time()))
        await asyncio.sleep(self.delay_s)
        ids = self.tok.encode(self.scripts[traj][int(turn)], add_special_tokens=False)
        finish = "stop"
        if len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
        return Generation(ids, [-0.5 - 0.001 * i for i in range(len(ids))], finish)


class FakeTools:
    def __init__(self, latency_s: float = 0.0, stdout: str | None = None):
        self.latency_s, self.stdout, self.codes = latency_s, stdout, []

    async def run(self, code, stdin="", session=None, timeout_s=None):
        self.codes.append(code)
        await asyncio.sleep(self.latency_s)
        if "raise" in code:
            return {"status": "error", "stdout": "", "stderr": "ValueError at line 1: boom", "wall_s": 0.01}
        return {"status": "ok", "stdout": self.stdout or f"ran {len(self.codes)}", "stderr": "", "wall_s": 0.02}


def call(code: str) -> str:
    return "<reason>let me compute " + render_tool_call(code) + IM_END


ANSWER = "<reason>done</reason>\n<answer>\\boxed{42}</answer>" + IM_END


def loop(tok, engine, tools=None, **cfg):
    base = dict(max_turns=4, max_prompt_length=1024, max_response_length=512, tool_output_max_chars=256)
    return AgentLoop(engine, tools or FakeTools(), tok, AgentConfig(**{**base, **cfg}))
