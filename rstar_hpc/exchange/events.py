"""The run's fault events, `launch/events.jsonl`: what a launcher (the sbatch supervisor, a submitit RoleJob) or the
rollout's keeper did about a fault: a role that crashed or hung and was started again, a sandbox service that died and was restarted, a
job that gave up, a role that refused its inputs, a node lost. `rstar-hpc run status` reads them into its `faults` and `problems`. Stdlib only.

Each event is one JSON line appended with a single write(2) on an O_APPEND descriptor, so the launchers of one run
(three RoleJobs under submitit) may append at once without losing or mixing lines; a line cut by a kill is
skipped by the reader. Nothing reads it to decide anything: it is a record for people.

    record_event(paths, "hang", role="rollout", host="gpu1", doing="step 3 of stage rl: generating", silent_s=730)
"""
from __future__ import annotations

import json
import os
import socket
import time

from rstar_hpc.exchange.rundir import RunPaths

KINDS = ("crash", "hang", "gave_up", "refused", "node_lost", "job_stranded", "engine_lost", "engine_hung",
         "engine_back", "engine_gave_up")
"""crash: a role's step ended before its stages were done; hang: its heartbeat went stale and its step was killed;
gave_up: it failed more often than launch.role_restarts allows; refused: it refused its config or inputs (exit 78,
cli/exit_codes.py; `message` says why), which no restart can fix, so its job stopped without a requeue; node_lost:
a node of the job went DOWN or stopped answering (launch/nodes.py), so the job was requeued onto the nodes that are
left; job_stranded: Slurm requeued the run's hetjob without one of its components, so it could never start again
(launch/status.stranded), and the launcher cancelled it and submitted the run again (`resubmitted`: the new job).
The rollout's own: engine_lost:
an engine rank died or went silent, its unfinished trajectories requeued (`requeued`); engine_hung: its rank went
on reporting but its engine made no token for rollout.scheduler.engine_stall_s (the evidence in `reason`), requeued
the same way and its keeper told to kill it whole and start it again; engine_back: it joined
again (rollout/keeper.py started it again); engine_gave_up: it died more often than launch.rollout.engine_restarts
allows, and the job goes on without it."""


def record_event(paths: RunPaths, kind: str, *, role: str, **fields: object) -> dict:
    """Append one event (time, host and Slurm job added); returns it. Never raises for I/O: an event is a record,
    and a launcher must go on restarting roles on a file system that refuses it."""
    if kind not in KINDS:
        raise ValueError(f"event kind {kind!r} is not one of {KINDS}")
    event = {"time": time.time(), "kind": kind, "role": role, "host": fields.pop("host", None) or socket.gethostname(),
             "slurm_job_id": os.environ.get("SLURM_JOB_ID"), **fields}
    line = (json.dumps(event, sort_keys=True) + "\n").encode()
    try:
        paths.launch_events.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(paths.launch_events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)   # one write: concurrent appenders never interleave inside a line
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    return event


def read_events(paths: RunPaths, since: float | None = None) -> list[dict]:
    """The run's events, oldest first (those at or after `since`, a wall time, when given)."""
    out = []
    try:
        with open(paths.launch_events) as f:
            for line in f:
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue   # cut by a kill mid-write
                if isinstance(event, dict) and (since is None or event.get("time", 0) >= since):
                    out.append(event)
    except FileNotFoundError:
        pass
    return out
