"""The stage driver's rules: which role works in which stage, in what order, on which policy, and when a stage
is done. Every role walks `stages[]` with these functions, so a restarted job of any role finds its place from
the run directory alone (the roles never talk to each other):

    kind         trainer                         rollout
    sft          trains it                       -
    rl           trains each step's trajectories  generates step N with the policy trained through N - lag;
                                                 validates it every val_every steps and at the end
    hard_subset  -                               samples num_samples rollouts per prompt with the stage's
                                                 starting policy; writes data/<stage>.parquet (+ stats)
    eval         -                               the eval protocol on the stage's benchmarks; eval/<stage>/

A stage's starting policy is the final one of the nearest earlier trainer stage (sft or rl), or the base model.
Stage state (stages/<stage>/state.json) is written by the role that owns the stage: the trainer for sft and rl,
the rollout for hard_subset and eval.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from rstar_hpc.config.stages import StageConfig
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.state import read_stage_state

TRAINER_KINDS = ("sft", "rl")
ROLLOUT_KINDS = ("rl", "hard_subset", "eval")
PRODUCER = "rollout"   # the rollout's final commit of a step (the trainer reads this producer)


@dataclass(frozen=True)
class PolicyNeed:
    """The policy a rollout step must run: published by trainer stage `stage` at `trainer_step` or later; with
    `stage` None, the base model."""
    stage: str | None
    trainer_step: int = 0

    def __str__(self) -> str:
        return "the base model" if self.stage is None else \
            f"the policy of stage {self.stage!r} after trainer step {self.trainer_step}"


def stage_index(cfg, name: str) -> int:
    return [s.name for s in cfg.stages].index(cfg.stage(name).name)


def previous_trainer_stage(cfg, name: str):
    """The nearest trainer stage (sft or rl) before stage `name`, or None."""
    earlier = [s for s in cfg.stages[:stage_index(cfg, name)] if s.kind in TRAINER_KINDS]
    return earlier[-1] if earlier else None


def rollout_stages(cfg, stage: str | None = None) -> list:
    """The stages a rollout job works on: `stage` alone, else every rollout-kind stage of the run, in order."""
    return [cfg.stage(stage)] if stage else [s for s in cfg.stages if s.kind in ROLLOUT_KINDS]


def warmup_steps(cfg, name: str) -> int:
    """The linear lr warm-up trainer stage `name` starts with. The optimizer warms up once per phase, as the paper
    does: in the run's first trainer stage, where the kind changes (sft -> rl: RL's own lr), and where a stage
    resets the optimizer. A stage that carries on the previous stage's optimizer goes straight to its lr (rl-12k
    continues rl-8k). `stages[].warmup_steps` overrides either way."""
    stage = cfg.stage(name)
    if stage.warmup_steps is not None:
        return stage.warmup_steps
    prev = previous_trainer_stage(cfg, name)
    fresh = prev is None or prev.kind != stage.kind or stage.reset_optimizer
    return cfg.trainer.optimizer.warmup_steps if fresh else 0


def starting_policy(cfg, name: str) -> PolicyNeed:
    """The policy stage `name` starts from: the previous trainer stage's final one, or the base model."""
    prev = previous_trainer_stage(cfg, name)
    return PolicyNeed(None) if prev is None else PolicyNeed(prev.name, prev.num_steps)


def policy_need(cfg, stage: str, step: int) -> PolicyNeed:
    """What rollout step `step` of `stage` runs: in an rl stage, on-policy, step N the weights trained on step
    N - 1 of the stage (rollout.scheduler.policy_lag steps older: overlap mode or max_policy_lag); before that, and in hard_subset
    and eval stages, the stage's starting policy."""
    if cfg.stage(stage).kind == "rl":
        need = step - cfg.rollout.scheduler.policy_lag
        if need > 0:
            return PolicyNeed(stage, need)
    return starting_policy(cfg, stage)


def rollout_steps(stage_cfg: StageConfig, num_prompts: int | None = None) -> int:
    """Rollout steps of a stage: an rl stage's num_steps; a hard_subset or eval stage's prompts in chunks of
    prompts_per_step (`num_prompts` of them)."""
    if stage_cfg.kind == "rl":
        return stage_cfg.num_steps
    return max(1, math.ceil((num_prompts or 0) / stage_cfg.prompts_per_step))


def val_points(stage_cfg: StageConfig) -> list[int]:
    """The steps at which an rl stage's policy is validated (stages[].val_every N): 0, N, 2N, ... and the stage's
    end, num_steps (its final policy). Point p scores the policy rollout step p runs; point num_steps the final."""
    if stage_cfg.kind != "rl" or not stage_cfg.val_every:
        return []
    return sorted(set(range(0, stage_cfg.num_steps, stage_cfg.val_every)) | {stage_cfg.num_steps})


def val_need(cfg, stage_cfg: StageConfig, point: int) -> PolicyNeed:
    """The policy validation point `point` scores: rollout step `point`'s (engines hold it already), or at the
    stage's end the final one."""
    return PolicyNeed(stage_cfg.name, point) if point >= stage_cfg.num_steps else policy_need(cfg, stage_cfg.name, point)


def val_done(paths: RunPaths, stage_cfg: StageConfig, point: int) -> bool:
    return paths.val_results(stage_cfg.name, point).exists()


def stage_done(paths: RunPaths, stage: str) -> bool:
    """Whether a stage is over for every role: its owner marks it DONE (the trainer at an sft or rl stage's last
    checkpoint; the rollout once a hard_subset stage's subset or an eval stage's results are written)."""
    return read_stage_state(paths, stage).status == "DONE"


def rollout_done(cfg, paths: RunPaths, stage: str) -> bool:
    """Whether the rollout has nothing left to do in stage `stage`."""
    s = cfg.stage(stage)
    if s.kind == "sft":
        return True
    if s.kind == "rl":
        from rstar_hpc.exchange.writer import ShardWriter
        steps_done = stage_done(paths, stage) or all(
            ShardWriter.is_committed(paths, stage, n, PRODUCER) for n in range(s.num_steps))
        return steps_done and all(val_done(paths, s, p) for p in val_points(s))
    return stage_done(paths, stage)


def uncommitted_steps(paths: RunPaths, stage: str, num_steps: int) -> Iterator[int]:
    """The stage walk's steps: the lowest step not committed, looked up again after each one is done, so that a
    step the trainer took back (corrupt on disk, exchange/quarantine.py) is written again before the walk goes on.
    Steps a consumer acked are never looked at (consumed; retention may have deleted them)."""
    from rstar_hpc.exchange.reader import consumer_cursors
    from rstar_hpc.exchange.writer import ShardWriter

    last = None
    while True:
        low = min(consumer_cursors(paths, stage).values(), default=0)
        step = next((s for s in range(low, num_steps) if not ShardWriter.is_committed(paths, stage, s, PRODUCER)),
                    None)
        if step is None:
            return
        if step == last:
            raise RuntimeError(f"step {step} of stage {stage!r} is still not committed after it ran "
                               f"({paths.traj_commit(stage, step, PRODUCER)} missing); see the rollout log above")
        last = step
        yield step


def taken_back(cfg, paths: RunPaths, need: PolicyNeed) -> list[int]:
    """Trajectory steps policy `need` is trained on that are not committed (any more): steps the trainer took back
    as corrupt. That policy cannot come before they are written again, so a step waiting for it gives way."""
    if need.stage is None or cfg.stage(need.stage).kind != "rl":
        return []
    from rstar_hpc.exchange.reader import consumer_cursors
    from rstar_hpc.exchange.writer import ShardWriter

    low = min(consumer_cursors(paths, need.stage).values(), default=0)
    return [s for s in range(low, need.trainer_step)
            if not ShardWriter.is_committed(paths, need.stage, s, PRODUCER)]


def stage_prompts(cfg, stage_cfg: StageConfig) -> list[dict]:
    """All prompts a rollout stage draws from (rl: its data; hard_subset: the source; eval: every benchmark's),
    system turns kept where the stage's `keep_system` says so."""
    from rstar_hpc.data.sets import load_prompt_file, load_prompts

    limit, keep = stage_cfg.max_prompts, stage_cfg.keep_system
    if stage_cfg.kind == "eval":
        out = []
        for name, data in stage_cfg.benchmark_files().items():
            out += [dict(p, uid=f"{name}/{p['uid']}")
                    for p in load_prompt_file(data, cfg.run.seed, keep_system=keep)[:limit]]
        return out
    if stage_cfg.kind == "hard_subset":
        return load_prompt_file(stage_cfg.data, cfg.run.seed, keep_system=keep)[:limit]
    return load_prompts(stage_cfg, seed=cfg.run.seed, run_dir=cfg.run.dir)[:limit]


def sample_count(cfg, stage_cfg: StageConfig) -> int:
    """Rollouts per prompt: rl the algorithm's group size (2G, or G in grpo mode), hard_subset its num_samples,
    eval its num_samples or eval.k."""
    if stage_cfg.kind == "rl":
        return cfg.algo.samples_per_prompt
    if stage_cfg.kind == "hard_subset":
        return stage_cfg.num_samples
    return stage_cfg.num_samples or cfg.eval.k
