"""StageState: where a pipeline stage stands, committed atomically to `stages/<stage>/state.json`.

A stage's job reads it at start (resume), rewrites it after each committed step, and marks DONE or FAILED on
exit; the launcher reads it to decide what to submit next. Allowed moves:

    PENDING -> RUNNING -> DONE
                  |  ^
                  v  |  (requeue / restart)
                 FAILED
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, replace

from rstar_hpc.exchange.atomic import atomic_write_json
from rstar_hpc.exchange.errors import ExchangeError
from rstar_hpc.exchange.rundir import RunPaths

STATUSES = ("PENDING", "RUNNING", "DONE", "FAILED")
_MOVES = {"PENDING": {"PENDING", "RUNNING", "FAILED"}, "RUNNING": {"RUNNING", "DONE", "FAILED"},
          "FAILED": {"RUNNING", "FAILED"}, "DONE": {"DONE"}}


@dataclass(frozen=True)
class StageState:
    stage: str
    status: str = "PENDING"
    step: int = 0
    """Last completed (checkpointed) step of the stage."""
    data_cursor: int = 0
    """Index of the next prompt to draw from the stage's data set."""
    policy_version: int = 0
    """Version of the newest published policy."""
    updated_at: float = field(default_factory=time.time)
    slurm_job_id: str | None = None
    message: str = ""
    """Why it FAILED, or a note for humans."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"stage {self.stage!r}: status {self.status!r} is not one of {STATUSES}")

    def advance(self, status: str | None = None, **changes: object) -> "StageState":
        """The next state; refuses moves the state machine does not allow (e.g. DONE -> RUNNING)."""
        status = status or self.status
        if status not in _MOVES[self.status]:
            raise ExchangeError(f"stage {self.stage!r} cannot go {self.status} -> {status} (allowed: "
                                f"{sorted(_MOVES[self.status])}). A DONE stage is rerun under a new stage name.")
        return replace(self, status=status, updated_at=time.time(),
                       slurm_job_id=os.environ.get("SLURM_JOB_ID", self.slurm_job_id), **changes)


def read_stage_state(paths: RunPaths, stage: str) -> StageState:
    """The committed state, or a fresh PENDING one if the stage never started."""
    path = paths.stage_state(stage)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return StageState(stage=stage)
    except json.JSONDecodeError as e:
        raise ExchangeError(f"{path} is not valid JSON ({e}); it is written atomically, so something else wrote "
                            f"it. Restore it from the stage's checkpoint marker or delete it to restart the stage.")
    unknown = sorted(set(record) - set(StageState.__dataclass_fields__))
    if unknown:
        raise ExchangeError(f"{path}: unknown keys {unknown}; written by a newer rstar-hpc?")
    return StageState(**record)


def write_stage_state(paths: RunPaths, state: StageState) -> None:
    path = paths.stage_state(state.stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, asdict(state), what="stage state")


def write_heartbeat(paths: RunPaths, role: str, doing: str, **fields: object) -> None:
    """What a role is doing now (`heartbeat/<role>.json`), for `rstar-hpc run status`: its text, when, where."""
    path = paths.heartbeat(role)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"role": role, "doing": doing, "time": time.time(), "pid": os.getpid(),
                             "host": os.uname().nodename, "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                             **fields}, what="heartbeat")


def read_heartbeat(paths: RunPaths, role: str) -> dict | None:
    try:
        return json.loads(paths.heartbeat(role).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def silence_s(paths: RunPaths, role: str, since: float) -> float:
    """Seconds since `role` last said anything (its heartbeat), counted from `since` (a monotonic-free wall time)
    when it said nothing after that: how long a waiting role has heard nothing of the one it waits for."""
    beat = read_heartbeat(paths, role)
    last = max(since, beat["time"]) if beat else since
    return max(0.0, time.time() - last)
