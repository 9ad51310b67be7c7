"""What a launcher watches in a running role besides its exit: its heartbeat (a hung role), and how it ends a step.

Both launchers (the sbatch supervisor, a submitit RoleJob) use these, so they agree on what "hung" means:
- `stale(paths, role, since, timeout_s)`: the trainer or rollout heartbeat (RUN/heartbeat/<role>.json, written by
  rank 0 in every phase) older than `launch.hang_timeout_s`, counted from the role's start when it has not beaten
  since (a heartbeat left by an earlier attempt says nothing of this one). The sandbox's heartbeat is its services'
  announcements (RUN/rendezvous/sandbox/<name>.json), which each service refreshes every
  `sandbox.stats_interval_s` from its event loop: a service that stops answering (stopped, its loop stuck) stops
  refreshing, and the oldest announcement of this attempt's services is the role's;
- `kill_step(proc)`: ends a role's step even when its tasks are SIGSTOPped or stuck in the kernel, and when its srun
  client stopped answering too: the step is then cancelled through Slurm (`named_step` names it for this);
- `end_step(proc)`: ends a healthy role's step gracefully (the sandbox's, once the run is done), so its tasks clean up.
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
    beat = _sandbox_beat(paths, since) if role == "sandbox" else read_heartbeat(paths, role)
    fresh = beat is not None and beat.get("time", 0) >= since
    last = beat["time"] if fresh else since
    if now - last < timeout_s:
        return None
    doing = beat["doing"] if fresh else "starting (no heartbeat since it started)"
    phase = (beat.get("phase") if fresh else "start") or doing
    return {"silent_s": round(now - last, 1), "doing": doing, "phase": phase,
            "host": beat.get("host") if fresh else None}


def _sandbox_beat(paths: RunPaths, since: float) -> dict | None:
    """The sandbox services' heartbeat: the stalest announcement refreshed since the role's start (an earlier
    attempt's service, never refreshed since, is not this one's), as a heartbeat record; None before any."""
    from rstar_hpc.exchange.rendezvous import read_announcements

    mine = [a for a in read_announcements(paths.dir, "sandbox") if a.get("updated_at", 0) >= since]
    if not mine:
        return None
    a = min(mine, key=lambda r: r["updated_at"])
    return {"time": a["updated_at"], "host": a.get("host"), "phase": "serve",
            "doing": f"sandbox service {a['name']} serving ({a.get('in_flight', '?')} calls in flight, "
                     f"{a.get('queue_depth', '?')} queued)"}


def end_step(proc: subprocess.Popen, argv: list[str], grace_s: float = 30.0) -> None:
    """End a healthy role's step so that its tasks can clean up: an srun through kill_step's two SIGINTs (its tasks
    get SIGINT, then SIGTERM, and SIGKILL only after KillWait; a SIGTERM to srun instead "forces job termination",
    killing them at once), a role run without srun with SIGTERM; SIGKILL to its process group after `grace_s`."""
    if argv and Path(argv[0]).name == "srun":
        kill_step(proc, argv, grace_s)
        return
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        kill_step(proc, argv, grace_s)


def kill_step(proc: subprocess.Popen, argv: list[str], grace_s: float = 60.0) -> None:
    """End a role's step and wait for it. An srun gets two SIGINTs within a second, its documented way to end the
    step: Slurm signals every task of it, on every node, then SIGKILLs them after KillWait (a stopped task dies of
    SIGKILL too). If it has not ended after `grace_s` (or the role runs without srun: submitit's one-task roles,
    an own mpirun), its process group gets SIGKILL (the launchers start roles in a session of their own). An srun
    that did not answer leaves its step in Slurm, holding the step's resources (a new srun of the role would stay
    pending): a step `named_step` named is then cancelled through Slurm, and waited for."""
    if proc.poll() is not None:
        return
    srun = bool(argv) and Path(argv[0]).name == "srun"
    if srun:
        try:
            proc.send_signal(signal.SIGINT)
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)
            if _wait_unless_stopped(proc, grace_s):
                return
            log.error("srun of the step did not end after two SIGINTs (%s); killing its process group",
                      "it is stopped" if _stopped(proc.pid) else f"{grace_s:.0f} s")
        except ProcessLookupError:
            return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()
    name = next((a.split("=", 1)[1] for a in argv if a.startswith("--job-name=")), None) if srun else None
    if name:
        cancel_step(name, grace_s)


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _wait_unless_stopped(proc: subprocess.Popen, grace_s: float) -> bool:
    """Wait up to `grace_s` for `proc` to end; True if it did. A stopped srun cannot answer: no use waiting."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            proc.wait(0.5)
            return True
        except subprocess.TimeoutExpired:
            if _stopped(proc.pid):
                return False
    return proc.poll() is not None


STEP_PREFIX = "rstar-"


def named_step(argv: list[str], role: str) -> list[str]:
    """An srun line whose step is named after the role (rstar-<role>), so that it can be found among the job's steps
    in Slurm (`squeue -s`); another command line as it is."""
    if not argv or Path(argv[0]).name != "srun":
        return argv
    return [argv[0], f"--job-name={STEP_PREFIX}{role}", *argv[1:]]


def _job_ids() -> list[str]:
    """This job's ids: the job's and each het component's (a component has a job id of its own)."""
    ids = {v for k, v in os.environ.items() if k == "SLURM_JOB_ID" or
           (k.startswith(("SLURM_JOB_ID_HET_GROUP_", "SLURM_JOB_ID_PACK_GROUP_")) and v)}
    return sorted(ids)


def _steps_named(jobs: list[str], name: str) -> list[str]:
    """Ids (JOB.STEP) of the steps of `jobs` named `name` that Slurm still holds."""
    out = subprocess.run(["squeue", "-h", "-s", "-j", ",".join(jobs), "-o", "%i %j"], capture_output=True,
                         text=True, timeout=30)
    if out.returncode != 0:
        raise OSError(f"squeue -s failed: {out.stderr.strip()}")
    return [f[0] for f in (line.split() for line in out.stdout.splitlines()) if len(f) == 2 and f[1] == name]


def cancel_step(name: str, wait_s: float = 60.0) -> None:
    """Cancel this job's step named `name` through Slurm (`scancel JOB.STEP`: its tasks get SIGKILL after
    KillWait, stopped or not) and wait up to `wait_s` until Slurm lets it go, logging what happened."""
    jobs = _job_ids()
    if not jobs:
        return
    t0 = time.monotonic()
    try:
        steps = _steps_named(jobs, name)
        if not steps:
            return
        log.warning("step %s (%s) is still in Slurm after its srun was killed: cancelling it (scancel)",
                    ",".join(steps), name)
        subprocess.run(["scancel", *steps], capture_output=True, timeout=30)
        while _steps_named(jobs, name):
            if time.monotonic() - t0 > wait_s:
                log.error("step %s (%s) still in Slurm %.0f s after scancel; starting the role anyway (its new srun "
                          "may wait for the step's resources)", ",".join(steps), name, wait_s)
                return
            time.sleep(0.5)
    except (OSError, subprocess.SubprocessError) as e:
        log.error("could not cancel step %s through Slurm (%s); its new srun may wait for the step's resources",
                  name, e)
        return
    log.warning("step %s (%s) is gone from Slurm after %.1f s", ",".join(steps), name, time.monotonic() - t0)
