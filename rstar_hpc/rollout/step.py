"""What one rollout step is, independent of who runs it: its work items, the seed of each trajectory, and how a
finished trajectory becomes a schema row (`Scorer`). The policy it runs comes from policy_source.py.

Each function takes the config sections it reads, never the whole run config.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rstar_hpc.config.algo import RewardConfig, RoCConfig
from rstar_hpc.config.rollout import AgentConfig
from rstar_hpc.config.stages import StageConfig, StageLimits
from rstar_hpc.exchange.schema import Trajectory
from rstar_hpc.rollout.agent import AgentResult
from rstar_hpc.rollout.messages import TrajectoryResult

log = logging.getLogger("rstar_hpc.rollout")


@dataclass
class WorkItem:
    prompt_uid: str
    sample_index: int
    prompt_ids: list[int]
    prompt_text: str
    answer: str
    resume: AgentResult | None = None
    """A paused trajectory's agent-loop state (its TrajectoryResult's output): migration, partial rollouts."""

    @property
    def key(self) -> tuple[str, int]:
        return (self.prompt_uid, self.sample_index)

    @property
    def context_tokens(self) -> int:
        """Its length now: the prompt, plus what it generated before a pause."""
        return len(self.prompt_ids) + (len(self.resume.response_ids) if self.resume is not None else 0)


@dataclass(frozen=True)
class StepSpec:
    """One rollout step as rank 0 runs it: which step, its work items, their limits, the policy it needs
    (pipeline.PolicyNeed; None: the base model) and the prompt uids dropped as over-long."""
    stage: str
    step: int
    items: Sequence[WorkItem]
    limits: StageLimits
    need: object = None
    dropped: Sequence[str] = ()


HEARTBEAT_S = 10.0   # the role's heartbeat file within a phase: often enough for `run status`, cheap on Lustre


@dataclass
class StepHooks:
    """What a step reports to and asks of its job: `progress(keys, tokens)` hears every finished trajectory's key and
    model tokens (rollout/progress.py), `beat(text, **fields)` writes the role's heartbeat file, `stop()` names a
    stop signal that arrived (USR2, TERM), `taken_back()` the uncommitted steps the step's policy is trained on."""
    progress: Callable[..., object] | None = None
    beat: Callable[..., object] | None = None
    stop: Callable[[], str | None] = lambda: None
    taken_back: Callable[[], list[int]] | None = None
    _beat_at: float = field(default=0.0, init=False)
    _phase: str = field(default="", init=False)

    def heartbeat(self, text: str, phase: str, every_s: float = HEARTBEAT_S, **fields) -> bool:
        """The role's heartbeat (RUN/heartbeat/rollout.json), at most every `every_s` within a phase and at once
        in a new one: `run status` shows it, and a launcher restarts the rollout when it goes stale
        (launch.hang_timeout_s), so the step's caller writes it only while the step moves. Whether it wrote."""
        now = time.monotonic()
        if self.beat is None or (now - self._beat_at < every_s and phase == self._phase):
            return False
        self._beat_at, self._phase = now, phase
        self.beat(text, phase=phase, **fields)
        return True


# --------------------------------------------------------------------------------------------------- step input
def step_items(stage_cfg: StageConfig, step: int, tokenizer, rows: list[dict], *, agent: AgentConfig,
               samples_per_prompt: int) -> tuple[list[WorkItem], list[str]]:
    """An rl step's prompts (out of the stage's `rows`, data/sets.load_prompts) x samples_per_prompt, and the
    uids of prompts dropped as over-long (microsoft/rStar filters them too: they cannot be trained on)."""
    n = stage_cfg.prompts_per_step
    if n > len(rows):
        raise ValueError(f"stage {stage_cfg.name!r}: prompts_per_step={n} but the data has {len(rows)} prompts; a step "
                         f"cannot hold a prompt twice (its uid names one GRPO group): lower prompts_per_step")
    prompts = [rows[(step * n + i) % len(rows)] for i in range(n)]   # epochs wrap around the file
    return make_items(prompts, tokenizer, agent=agent, samples_per_prompt=samples_per_prompt)


def make_items(prompts: list[dict], tokenizer, *, agent: AgentConfig,
               samples_per_prompt: int) -> tuple[list[WorkItem], list[str]]:
    """`prompts` ({"uid", "question", "answer"}, + "system" where the stage kept a prompt's own system turn) x
    samples_per_prompt as work items; over-long ones dropped."""
    from rstar_hpc.rollout.agent import PromptTooLong, encode_prompt

    items, dropped = [], []
    for p in prompts:
        uid = p["uid"]
        try:
            ids, text = encode_prompt(tokenizer, p["question"], agent, p.get("system"))
        except PromptTooLong as e:
            log.warning("dropping prompt %s: %s", uid, e)
            dropped.append(uid)
            continue
        items += [WorkItem(uid, s, ids, text, str(p["answer"])) for s in range(samples_per_prompt)]
    return items, dropped


def request_seed(run_seed: int, stage: str, step: int, prompt_uid: str, sample_index: int) -> int:
    """A sampling seed per trajectory, the same wherever and whenever it runs (a re-run after an engine's
    death samples what the lost run would have): reproducible for a given run seed."""
    h = hashlib.blake2b(f"{run_seed}/{stage}/{step}/{prompt_uid}/{sample_index}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1


# --------------------------------------------------------------------------------------------------- output
def trajectory_figures(trajs: list[Trajectory]) -> dict:
    """A step's figures over its trajectories (its summary in metrics/rollout.jsonl; the report's tool-calls plot;
    tool errors counted as rstar_hpc.eval counts them)."""
    n, calls = max(1, len(trajs)), sum(len(t.tool_calls) for t in trajs)
    return {"tool_wait_s": round(sum(t.timings.tool_s for t in trajs), 3),
            "generate_s": round(sum(t.timings.generate_s for t in trajs), 3),
            "mean_reward": sum(t.reward for t in trajs) / n,
            "tool_calls_per_trajectory": calls / n,
            "tool_error_ratio": sum(c.is_error for t in trajs for c in t.tool_calls) / calls if calls else None,
            "finish_reasons": {r: sum(t.finish_reason == r for t in trajs) for r in {t.finish_reason for t in trajs}}}


@dataclass(frozen=True)
class Scorer:
    """An engine rank's finished trajectory (messages.TrajectoryResult) -> a schema Trajectory: outcome reward and
    RoC quality signals."""
    run: str
    """Run name, recorded in every row."""
    reward: RewardConfig
    roc: RoCConfig

    def __call__(self, stage: str, step: int, it: WorkItem, result: TrajectoryResult, queue_s: float) -> Trajectory:
        from rstar_hpc.algo.quality import trajectory_quality
        from rstar_hpc.algo.reward import score_response

        out = result.output
        response = out.response_text
        t0 = time.perf_counter()
        if out.finish_reason == "aborted":
            reward, answer = 0.0, None
        else:
            r = score_response(response, it.answer, self.reward)
            reward, answer = float(r.score), r.answer
        q = trajectory_quality(response, [c.status for c in out.tool_calls], out.num_assistant_turns, self.roc)
        timings = dataclasses.replace(out.timings, queue_s=queue_s, reward_s=time.perf_counter() - t0)
        versions = out.token_policy_versions   # resumed on a newer policy: tokens of several versions
        versions = versions if versions and any(v != result.policy_version for v in versions) else None
        return Trajectory(run=self.run, stage=stage, step=step, prompt_uid=it.prompt_uid,
                          sample_index=it.sample_index, policy_version=result.policy_version,
                          engine_rank=result.engine_rank, prompt_ids=it.prompt_ids, response_ids=out.response_ids,
                          loss_mask=out.loss_mask, logprobs=out.logprobs, turns=out.turns,
                          prompt_text=it.prompt_text, tool_calls=out.tool_calls, finish_reason=out.finish_reason,
                          answer=answer, reward=reward, p_err=q.p_err, p_format=q.p_format,
                          timings=timings, token_policy_versions=versions).validate()
