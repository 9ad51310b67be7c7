"""What the rollout role runs, stage by stage: each rollout stage (rl, hard_subset, eval) as a sequence of rollout
steps (work items, limits, sampling, the policy each needs), and what a finished hard_subset or eval stage
leaves behind. The rules of order and policy are rstar_hpc.pipeline's.

    rl           step N: prompts_per_step prompts of the stage's data from position N x prompts_per_step (epochs
                 wrap around the file), each x algo.num_samples_per_prompt
    hard_subset  the source data in chunks of prompts_per_step, each prompt x num_samples (8)
    eval         every benchmark's problems (uids "<benchmark>/<uid>"), in chunks, each x k
"""
from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from rstar_hpc import pipeline
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.config.stages import StageLimits
from rstar_hpc.rollout.step import WorkItem, make_items, step_items

log = logging.getLogger("rstar_hpc.rollout")


@dataclass
class RolloutStep:
    stage: str
    step: int
    items: list[WorkItem]
    dropped: list[str]
    limits: StageLimits
    need: pipeline.PolicyNeed


def stage_steps(cfg, paths: RunPaths, stage_name: str, tokenizer, *, steps: Sequence[int] | None = None
                ) -> Iterator[RolloutStep]:
    """The rollout steps of a stage not committed yet (or exactly `steps`), in order; a step the trainer took back
    (corrupt on disk) comes again. Work items are built only for the steps that run: prompts are read once."""
    stage = cfg.stage(stage_name)
    rows = pipeline.stage_prompts(cfg, stage)
    limits = cfg.stage_limits(stage)
    samples = pipeline.sample_count(cfg, stage)
    n = pipeline.rollout_steps(stage, len(rows))
    for step in (pipeline.uncommitted_steps(paths, stage.name, n) if steps is None else steps):
        if stage.kind == "rl":
            items, dropped = step_items(stage, step, tokenizer, rows, agent=cfg.rollout.agent,
                                        samples_per_prompt=samples)
        else:
            chunk = rows[step * stage.prompts_per_step:(step + 1) * stage.prompts_per_step]
            items, dropped = make_items(chunk, tokenizer, agent=cfg.rollout.agent, samples_per_prompt=samples)
        yield RolloutStep(stage.name, step, items, dropped, limits, pipeline.policy_need(cfg, stage.name, step))


def finish_stage(cfg, paths: RunPaths, stage_name: str) -> dict | None:
    """After every rollout step of a hard_subset or eval stage committed: its output, and the stage DONE.
    Returns the output's summary (None for rl stages, which the trainer finishes)."""
    stage = cfg.stage(stage_name)
    if stage.kind == "rl":
        return None
    num_steps = pipeline.rollout_steps(stage, len(pipeline.stage_prompts(cfg, stage)))
    if stage.kind == "hard_subset":
        from rstar_hpc.rollout.hard_subset import write_hard_subset
        out = write_hard_subset(cfg, paths, stage, num_steps)
    else:
        from rstar_hpc.eval.results import write_eval_results
        out = write_eval_results(cfg, paths, stage, num_steps)
    from rstar_hpc.exchange.state import read_stage_state, write_stage_state
    state = read_stage_state(paths, stage.name)
    if state.status != "DONE":
        write_stage_state(paths, state.advance("RUNNING").advance("DONE", step=num_steps,
                                                                  message=out.get("summary", "")))
    return out
