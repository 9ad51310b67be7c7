"""Rank 0's tally of one rollout step: its clock, its counters, and the summary they make (metrics/rollout.jsonl).

The scheduler counts into a StepTally as the step runs; `summary` turns it, the trajectories and the engines'
figures into the step's record, appended to metrics/rollout.jsonl (and TensorBoard) and logged.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.schema import Trajectory
from rstar_hpc.metrics_log import metrics_sink
from rstar_hpc.rollout.step import trajectory_figures

log = logging.getLogger("rstar_hpc.rollout")


@dataclass
class StepTally:
    stage: str
    step: int
    dropped: list[str] = field(default_factory=list)    # prompt uids dropped as over-long
    t_start: float = field(default_factory=time.monotonic)   # the step's start; generation's once its policy is there
    policy_wait_s: float = 0.0        # the rollout idle, waiting on the trainer
    policy_version: int | None = None  # the model policy the step generates with (None: the base model)
    kept_from_journal: int = 0
    reward_s: float = 0.0
    reruns: int = 0
    reruns_resumed: int = 0           # of the reruns, those resumed from a boundary or pause, not the start
    infra_failures: int = 0           # tool calls the sandbox's infrastructure lost, those of reruns included
    infra_reruns: int = 0             # trajectories run again from their prompt for such a loss
    engines: list[int] = field(default_factory=list)   # those that said HELLO

    def policy_ready(self) -> None:
        """The policy is there: what came before was waiting on the trainer; generation starts now."""
        now = time.monotonic()
        self.policy_wait_s, self.t_start = now - self.t_start, now

    def elapsed(self) -> float:
        return time.monotonic() - self.t_start

    def summary(self, paths: RunPaths, trajs: list[Trajectory], generation_s: float, *, last_admit_s: float,
                admission: str, lost: list[int],
                engine_stats: dict[int, dict], weights_via: dict, levers: dict) -> dict:
        """The step's record: appended to metrics/rollout.jsonl (and TensorBoard), logged, returned."""
        last_admit = last_admit_s
        out = {
            "step": self.step, "stage": self.stage, "admission": admission, "trajectories": len(trajs),
            "kept_from_journal": self.kept_from_journal, "dropped_prompts": self.dropped, "engines": self.engines,
            "dead_engines": lost, "reruns": self.reruns, "reruns_resumed": self.reruns_resumed,
            "wall_s": round(time.monotonic() - self.t_start, 3),   # from generation's start: policy_wait_s is apart
            "generation_wall_s": round(generation_s, 3),
            # the step's long tail: generation went on this long after its last trajectory was admitted
            "last_admit_s": round(last_admit, 3), "tail_s": round(generation_s - last_admit, 3),
            "reward_s": round(self.reward_s, 4), "policy_version": self.policy_version,
            "weights_via": {str(e): w.get("via") for e, w in weights_via.items()},
            "policy_wait_s": round(self.policy_wait_s, 3),
            "tool_infra_failures": self.infra_failures, "infra_reruns": self.infra_reruns,
            **trajectory_figures(trajs),
            "engine_stats": {str(k): v for k, v in engine_stats.items()}, **levers,
        }
        metrics_sink(paths, "rollout").write(out)
        log.info("step %d of stage %s: %d trajectories in %.1f s (generation %.1f s, all admitted by %.1f s, tail "
                 "%.1f s; tool wait %.1f s summed over trajectories; reward %.2f s on rank 0; mean reward %.3f)",
                 self.step, self.stage, len(trajs), out["wall_s"], generation_s, out["last_admit_s"],
                 out["tail_s"], out["tool_wait_s"], self.reward_s, out["mean_reward"])
        return out
