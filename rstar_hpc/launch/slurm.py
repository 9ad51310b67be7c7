"""Submit an sbatch template and follow the job, with the Slurm commands themselves (no accounting
database needed: state comes from `scontrol show job`, which keeps finished jobs for MinJobAge)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from rstar_hpc.assets import sbatch_template

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE"}


class JobFailed(RuntimeError):
    """A job ended in a state other than COMPLETED, or did not end in time."""


def submit(template: str | os.PathLike, args: Sequence[str] = (), *, sbatch_args: Sequence[str] = (),
           env: Mapping[str, str] | None = None) -> str:
    """sbatch a template (a shipped one's name, rstar_hpc/assets.py, or a path); returns the job id. The job's
    environment is `env` (default: this process's), with RSTAR_PYTHON set to this Python unless it names one: the
    templates start `$RSTAR_PYTHON -m rstar_hpc ...`, so the job runs the install that submitted it."""
    path = Path(template)
    if not path.is_file():
        path = sbatch_template(str(template))
    env = {**(os.environ if env is None else env)}
    env.setdefault("RSTAR_PYTHON", sys.executable)
    proc = subprocess.run(["sbatch", "--parsable", *sbatch_args, str(path), *args], capture_output=True, text=True,
                          env=env, timeout=60)
    if proc.returncode != 0:
        raise JobFailed(f"sbatch {path.name} failed: {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]


def job_state(job_id: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`scontrol show job` fields of the job (for a hetjob: of component 0, the leader)."""
    proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                          env=dict(env) if env is not None else None, timeout=30)
    if proc.returncode != 0 or not proc.stdout.strip():
        return {}
    fields = {}
    for token in proc.stdout.splitlines()[0].split():
        key, _, value = token.partition("=")
        fields.setdefault(key, value)
    return fields


def wait_for_job(job_id: str, *, timeout_s: float = 600, env: Mapping[str, str] | None = None,
                 poll_s: float = 0.5, on_poll=None) -> dict[str, str]:
    """Block until the job ends; returns its fields, raises JobFailed if it did not complete."""
    deadline = time.monotonic() + timeout_s
    fields: dict[str, str] = {}
    while time.monotonic() < deadline:
        fields = job_state(job_id, env)
        state = fields.get("JobState", "UNKNOWN")
        if on_poll:
            on_poll(fields)
        if state in TERMINAL:
            if state != "COMPLETED":
                raise JobFailed(f"job {job_id} ended {state} (exit {fields.get('ExitCode')}, reason "
                                f"{fields.get('Reason')}); output: {fields.get('StdOut')}")
            return fields
        time.sleep(poll_s)
    raise JobFailed(f"job {job_id} still {fields.get('JobState', 'UNKNOWN')} after {timeout_s:.0f} s; "
                    f"see `scontrol show job {job_id}` and {fields.get('StdOut')}")
