"""What a launcher watches in a running role besides its exit: its heartbeat (a hung role), and how it ends a step.

Both launchers (the sbatch supervisor, a submitit RoleJob) use these, so they agree on what "hung" means:
- `stale(paths, role, since, timeout_s)`: the trainer or rollout heartbeat (RUN/heartbeat/<role>.json, written by
  rank 0 in every phase) older than `launch.hang_timeout_s`, counted from the role's start when it has not beaten
  since (a heartbeat left by an earlier attempt says nothing of this one);
- `kill_step(proc)`: ends a role's step even when its tasks are SIGSTOPped or stuck in the kernel.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from pathlib import Path

from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.state import read_heartbeat

log = logging.getLogger("rstar_hpc.launch")


def stale(paths: RunPaths, role: str, since: float, timeout_s: float, now: float | None = None) -> dict | None:
    """None while `role` is alive by its heartbeat; else what it last said: {"silent_s", "doing", "phase",
    "host"}. `since`: the wall time its current attempt started."""
    if timeout_s <= 0:
        return None
    now = time.time() if now is None else now
    beat = read_heartbeat(paths, role)
    fresh = beat is not None and beat.get("time", 0) >= since
    last = beat["time"] if fresh else since
    if now - last < timeout_s:
        return None
    doing = beat["doing"] if fresh else "starting (no heartbeat since it started)"
    phase = (beat.get("phase") if fresh else "start") or doing
    return {"silent_s": round(now - last, 1), "doing": doing, "phase": phase,
            "host": beat.get("host") if fresh else None}


def kill_step(proc: subprocess.Popen, argv: list[str], grace_s: float = 60.0) -> None:
    """End a role's step and wait for it. An srun gets two SIGINTs within a second, its documented way to end the
    step: Slurm signals every task of it, on every node, then SIGKILLs them after KillWait (a stopped task dies of
    SIGKILL too). If it has not ended after `grace_s` (or the role runs without srun: submitit's one-task roles,
    an own mpirun), its process group gets SIGKILL (the launchers start roles in a session of their own)."""
    if proc.poll() is not None:
        return
    if argv and Path(argv[0]).name == "srun":
        try:
            proc.send_signal(signal.SIGINT)
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)
            proc.wait(grace_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            log.error("srun of the step did not end %.0f s after two SIGINTs; killing its process group", grace_s)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()
