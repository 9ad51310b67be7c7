"""What one rollout step is, independent of who runs it: its work items, its limits, the policy it needs, the seed
of each trajectory, and how a finished trajectory becomes a schema row (`Scorer`).

Each function takes the config sections it reads, never the whole run config.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

from rstar_hpc.config.algo import RewardConfig, RoCConfig
from rstar_hpc.config.rollout import AgentConfig, SchedulerConfig
from rstar_hpc.config.stages import StageConfig
from rstar_hpc.exchange.rundir import RunPaths
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


class StageLimits(NamedTuple):
    """A stage's response budget, turn limit and sampling: the stage's own, else the agent loop's defaults (an
    eval stage: the eval protocol's). temperature/top_p None: the engine's (rollout.agent's)."""
    max_response_length: int
    max_turns: int
    temperature: float | None = None
    top_p: float | None = None

    @classmethod
    def of(cls, cfg, stage: StageConfig) -> StageLimits:
        """`cfg` (a RunConfig) says the response budget (RunConfig.response_budget, the one rule config validation
        checks against the engine context)."""
        budget = cfg.response_budget(stage)
        if stage.kind == "eval":
            protocol = cfg.eval
            return cls(budget, stage.max_turns or protocol.max_turns,
                       protocol.temperature if stage.temperature is None else stage.temperature,
                       protocol.top_p if stage.top_p is None else stage.top_p)
        return cls(budget, stage.max_turns or cfg.rollout.agent.max_turns)

    def sampling(self) -> dict | None:
        """The engine's sampling overrides, if any."""
        out = {k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p)) if v is not None}
        return out or None


# --------------------------------------------------------------------------------------------------- step input
def step_items(stage: StageConfig, step: int, tokenizer, rows: list[dict], *, agent: AgentConfig,
               samples_per_prompt: int) -> tuple[list[WorkItem], list[str]]:
    """An rl step's prompts (out of the stage's `rows`, datasets.load_prompts) x samples_per_prompt, and the
    uids of prompts dropped as over-long (microsoft/rStar filters them too: they cannot be trained on)."""
    n = stage.prompts_per_step
    if n > len(rows):
        raise ValueError(f"stage {stage.name!r}: prompts_per_step={n} but the data has {len(rows)} prompts; a step "
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


# --------------------------------------------------------------------------------------------------- policy
class StepGivesWay(Exception):
    """The policy a step waits for is trained on a step that is no longer committed (the trainer took it back as
    corrupt on disk, exchange/quarantine.py): that step is written again first. Nothing of this step ran yet."""


MEMORY = "memory"
"""wait_for_policy's directory when the version it picked is the trainer's in-memory offer (no files yet)."""


def in_memory(paths: RunPaths, need) -> int | None:
    """The version the trainer offers in memory (exchange/weight_sync.py, `trainer.weight_sync: memory`) if it
    satisfies `need` (same stage, trainer_step >= need's, as a COMMITTED.json is read), else None."""
    from rstar_hpc.exchange.weight_sync import read_offer

    offer = read_offer(paths.dir)
    if offer is None or offer.get("stage") != need.stage or int(offer.get("trainer_step", -1)) < need.trainer_step:
        return None
    return int(offer["version"])


def wait_for_policy(sc: SchedulerConfig, paths: RunPaths, need, *, what: str = "a rollout step", beat=None,
                    poll_s: float = 1.0, taken_back=None) -> tuple[int, str] | None:
    """(version, directory) of the newest published policy that satisfies `need` (pipeline.PolicyNeed), waiting
    for the trainer to publish it (`policy_wait_s`); None when `need` is the base model. A newer version the
    trainer offers in memory that satisfies `need` wins, and so does the same version: (version, MEMORY), and the
    engines sync it in memory. `beat(text)` hears what it waits for (the role's heartbeat, shown by
    `rstar-hpc run status`). `taken_back()`: the steps `need`
    is trained on that are uncommitted (pipeline.taken_back); any, and StepGivesWay (else the step and the trainer
    would wait for each other)."""
    if need.stage is None:
        return None
    from rstar_hpc.exchange.state import silence_s

    dirs = paths.policies()
    t0, wall0 = time.monotonic(), time.time()
    waited = False
    while True:
        files = next((v for v in sorted(dirs.complete_steps(), reverse=True)
                      if dirs.marker(v).get("stage") == need.stage
                      and int(dirs.marker(v).get("trainer_step", -1)) >= need.trainer_step), None)
        # read after the files: the trainer offers a version before it publishes it, so a version seen as files is
        # seen in the offer too; the same version in both is synced in memory (the faster way), files the fallback
        offer = in_memory(paths, need)
        if files is not None:
            return (offer, MEMORY) if offer is not None and offer >= files else (files, str(dirs.path(files)))
        if offer is not None:
            return offer, MEMORY
        if not waited:
            log.info("%s waits for %s (policy lag %d, mode %s)", what, need, sc.policy_lag, sc.mode)
            waited = True
        gone = taken_back() if taken_back is not None else []
        if gone:
            raise StepGivesWay(f"{what} waits for {need}, which is trained on steps {gone} of stage {need.stage}: "
                               f"no longer committed (taken back as corrupt); writing them again first")
        if beat is not None:
            beat(f"waiting for {need} since {time.monotonic() - t0:.0f}s")
        if silence_s(paths, "trainer", wall0) > sc.policy_wait_s:   # a trainer at work may take its time
            raise TimeoutError(
                f"{what} needs {need} (COMMITTED.json stage {need.stage!r}, trainer_step >= {need.trainer_step} "
                f"under {dirs.root}); the trainer said nothing for {sc.policy_wait_s:.0f}s (heartbeat/trainer.json)."
                f" Is it running? (rollout.scheduler.max_policy_lag allows older policies; policy_wait_s waits "
                f"longer)")
        time.sleep(poll_s)


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
