"""Where a run's wall time went, from its run directory: the job's start, then the seconds between one stage's end
and the next one's, then the run's end. The rows add up to the wall time from submission to the end, so a
regression in any of them (a slower start, a stage, a longer wait at the end) shows in the row that grew.

    phases = run_phases(paths, ["eval-base", "sft", "eval-sft"], submitted_at=t0, ended_at=t1)
    # {"start": 3.1, "eval-base": 24.8, "sft": 212.5, "eval-sft": 41.0, "end": 5.2, "wall": 286.6}

Stages of different roles overlap (the SFT run's base eval runs while the trainer trains), so a stage's row is the
time from the previous stage's end to its own, not its own span: eval-base's 25 s are also SFT's first 25 s.
"""
from __future__ import annotations

import json

from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.state import read_stage_state


def job_started_at(paths: RunPaths) -> float | None:
    """When the run's job last started on its nodes (the supervisor's allocation record), or None."""
    try:
        return float(json.loads(paths.allocation.read_text())["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run_phases(paths: RunPaths, stages: list[str], *, submitted_at: float, ended_at: float) -> dict[str, float | None]:
    """Seconds per phase: "start" (submission to the job's start: queue and allocation), one row per stage in
    order (from the previous row's end to the stage's DONE; None if it is not DONE), "end" (the last stage's DONE
    to `ended_at`: the roles' exit and the job's end), and "wall" (`ended_at` - `submitted_at`).

    A run done before this submission (its last job started before it: a demo run again over its runs) keeps its
    stage rows, counted from that job's start; its "start", "end" and "wall" are None, as none of them happened now."""
    started = job_started_at(paths)
    if started is not None and started < submitted_at:
        earlier = run_phases(paths, stages, submitted_at=started, ended_at=submitted_at)
        return {**earlier, "start": None, "end": None, "wall": None}
    out: dict[str, float | None] = {"start": None if started is None else round(max(0.0, started - submitted_at), 1)}
    mark = started if started is not None else submitted_at
    for name in stages:
        state = read_stage_state(paths, name)
        if state.status != "DONE":
            out[name] = None
            continue
        out[name] = round(max(0.0, state.updated_at - mark), 1)
        mark = max(mark, state.updated_at)
    out["end"] = round(max(0.0, ended_at - mark), 1)
    out["wall"] = round(ended_at - submitted_at, 1)
    return out


def phase_line(phases: dict[str, float | None]) -> str:
    """`start 3 | eval-base 25 | sft 213 | eval-sft 41 | end 5` (seconds; "-" for a stage not done)."""
    return " | ".join(f"{k} {'-' if v is None else f'{v:.0f}'}" for k, v in phases.items() if k != "wall")
