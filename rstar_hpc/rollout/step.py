"""What one rollout step is, independent of who runs it: its work items, its limits, the policy it needs, the seed
of each trajectory, and how a finished trajectory becomes a schema row (`Scorer`).

Each function takes the config sections it reads, never the whole run config.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

from rstar_hpc.config.algo import RewardConfig, RoCConfig
from rstar_hpc.config.rollout import AgentConfig, SchedulerConfig
from rstar_hpc.config.run import StageConfig
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.schema import Timings, ToolCall, Trajectory, Turn

log = logging.getLogger("rstar_hpc.rollout")


@dataclass
class WorkItem:
    prompt_uid: str
    sample_index: int
    prompt_ids: list[int]
    prompt_text: str
    answer: str

    @property
    def key(self) -> tuple[str, int]:
        return (self.prompt_uid, self.sample_index)


class StageLimits(NamedTuple):
    """A stage's response budget and turn limit: the stage's own, else the agent loop's defaults."""
    max_response_length: int
    max_turns: int

    @classmethod
    def of(cls, stage: StageConfig, agent: AgentConfig) -> StageLimits:
        return cls(stage.max_response_length or agent.max_response_length, stage.max_turns or agent.max_turns)


# --------------------------------------------------------------------------------------------------- step input
def step_items(stage: StageConfig, step: int, tokenizer, rows: list[dict], *, agent: AgentConfig,
               samples_per_prompt: int) -> tuple[list[WorkItem], list[str]]:
    """The step's prompts (out of the stage's `rows`, datasets.load_prompts) x samples_per_prompt, and the
    uids of prompts dropped as over-long (the reference filters them: they cannot be trained on)."""
    from rstar_hpc.rollout.agent import PromptTooLong, encode_prompt

    n = stage.prompts_per_step
    if n > len(rows):
        raise ValueError(f"stage {stage.name!r}: prompts_per_step={n} but the data has {len(rows)} prompts; a step "
                         f"cannot hold a prompt twice (its uid names one GRPO group): lower prompts_per_step")
    prompts = [rows[(step * n + i) % len(rows)] for i in range(n)]   # epochs wrap around the file
    items, dropped = [], []
    for p in prompts:
        uid = p["uid"]
        try:
            ids, text = encode_prompt(tokenizer, p["question"], agent.max_prompt_length)
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


# --------------------------------------------------------------------------------------------------- policy
def required_trainer_step(sc: SchedulerConfig, step: int) -> int | None:
    """The trainer step a policy must have reached to generate `step`: on-policy, step N runs the weights
    trained on step N-1 (trainer_step N), `max_policy_lag` steps older allowed. None: anything goes."""
    need = step - sc.max_policy_lag
    return need if need > 0 else None


def wait_for_policy(sc: SchedulerConfig, paths: RunPaths, stage: str, step: int, *,
                    poll_s: float = 1.0) -> tuple[int, str] | None:
    """(version, directory) of the newest published policy good enough for `step`, waiting for the trainer
    to publish it (`policy_wait_s`); None when the step may run the base model and nothing is published."""
    dirs = paths.policies()
    need = required_trainer_step(sc, step)
    deadline = time.monotonic() + sc.policy_wait_s
    waited = False
    while True:
        for v in sorted(dirs.complete_steps(), reverse=True):
            if need is None:
                return v, str(dirs.path(v))
            meta = dirs.marker(v)
            if meta.get("stage") == stage and int(meta.get("trainer_step", -1)) >= need:
                return v, str(dirs.path(v))
        if need is None:
            return None
        if not waited:
            log.info("step %d of stage %s waits for a policy with trainer_step >= %d (max_policy_lag=%d)",
                     step, stage, need, sc.max_policy_lag)
            waited = True
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rollout step {step} of stage {stage!r} needs a policy the trainer published after training "
                f"step {need} of that stage (COMMITTED.json trainer_step >= {need} under {dirs.root}); none "
                f"appeared in {sc.policy_wait_s:.0f}s. Is the trainer running? "
                f"(rollout.scheduler.max_policy_lag allows older policies; policy_wait_s waits longer)")
        time.sleep(poll_s)


# --------------------------------------------------------------------------------------------------- output
@dataclass(frozen=True)
class Scorer:
    """An engine rank's finished trajectory -> a schema Trajectory: outcome reward and RoC quality signals."""
    run: str
    """Run name, recorded in every row."""
    reward: RewardConfig
    roc: RoCConfig

    def __call__(self, stage: str, step: int, it: WorkItem, msg: dict, queue_s: float) -> Trajectory:
        from rstar_hpc.algo.quality import trajectory_quality
        from rstar_hpc.algo.reward import score_response

        turns = [Turn(**t) for t in msg["turns"]]
        calls = [ToolCall(**c) for c in msg["tool_calls"]]
        response = "".join(t.text for t in turns)
        t0 = time.perf_counter()
        if msg["finish_reason"] == "aborted":
            reward, answer = 0.0, None
        else:
            r = score_response(response, it.answer, self.reward)
            reward, answer = float(r.score), r.answer
        q = trajectory_quality(response, [c.status for c in calls], sum(t.role == "assistant" for t in turns),
                               self.roc)
        timings = Timings(**msg["timings"])
        timings.queue_s, timings.reward_s = queue_s, time.perf_counter() - t0
        return Trajectory(run=self.run, stage=stage, step=step, prompt_uid=it.prompt_uid,
                          sample_index=it.sample_index, policy_version=msg["policy_version"],
                          engine_rank=msg["engine_rank"], prompt_ids=it.prompt_ids, response_ids=msg["response_ids"],
                          loss_mask=msg["loss_mask"], logprobs=msg["logprobs"], turns=turns,
                          prompt_text=it.prompt_text, tool_calls=calls, finish_reason=msg["finish_reason"],
                          answer=answer, reward=reward, p_err=q.p_err, p_format=q.p_format,
                          timings=timings).validate()
