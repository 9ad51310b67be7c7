"""The Python launcher: the same role jobs the sbatch/ templates start, submitted through submitit.

    job = submit_command(cfg, "rollout", ["generate", "tiny-cpu", "--num-prompts", "4"])
    print(job.job_id, job.result())          # the command's stdout

Resources come from the config's `launch.<role>` section; jobs are requeueable and get USR2
`launch.signal_lead_s` seconds before their time limit (submitit's own handler requeues them). submitit cannot
express heterogeneous jobs (submitit#1741): co-scheduled roles go through the sbatch templates.
Without an accounting database (`sacct`), submitit tracks jobs through their result pickles; `wait` adds a
deadline so a job that dies without one cannot hang the caller.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

from rstar_hpc.config import RunConfig
from rstar_hpc.exchange.rundir import RunPaths

ROLES = ("trainer", "rollout", "sandbox")


def executor(cfg: RunConfig, role: str, *, tasks_per_node: int | None = None, folder: Path | None = None):
    """An AutoExecutor sized from `cfg.launch.<role>`, logging to <run>/logs/submitit/<job id>."""
    import submitit

    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
    res = getattr(cfg.launch, role)
    folder = folder or RunPaths(cfg.run.dir).logs / "submitit" / "%j"
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=cfg.launch.max_restarts)
    ex.update_parameters(
        name=f"rstar-{role}", timeout_min=res.time_min, nodes=res.num_nodes,
        tasks_per_node=tasks_per_node or res.tasks_per_node, cpus_per_task=res.cpus_per_task,
        slurm_partition=res.partition, slurm_signal_delay_s=cfg.launch.signal_lead_s,
        slurm_additional_parameters={"requeue": True},
        **({"gpus_per_node": res.gpus_per_node} if res.gpus_per_node else {}),
    )
    return ex


def submit_command(cfg: RunConfig, role: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                   tasks_per_node: int | None = 1):
    """Run `rstar-hpc ARGV` as a job of ROLE's resources, with this interpreter (a shared venv on clusters)."""
    import submitit

    command = submitit.helpers.CommandFunction([sys.executable, "-m", "rstar_hpc", *argv],
                                               env=dict(env) if env is not None else None)
    return executor(cfg, role, tasks_per_node=tasks_per_node).submit(command)


def wait(job, timeout_s: float = 600, poll_s: float = 1.0):
    """The job's result, or TimeoutError naming the job and its log after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not job.done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"submitit job {job.job_id} not done after {timeout_s:.0f} s; "
                               f"log: {job.paths.stdout} (state {job.state})")
        time.sleep(poll_s)
    return job.result()


def slurm_client_env(slurm_conf: str | os.PathLike | None) -> dict[str, str]:
    """submitit calls sbatch with this process's environment: point it at a cluster's slurm.conf."""
    return {**os.environ, **({"SLURM_CONF": str(slurm_conf)} if slurm_conf else {})}
