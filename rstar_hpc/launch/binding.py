"""A launched task binds itself to its GPUs (before anything touches CUDA) and records what it got.

Slurm binds what it can (placement.py): the trainer's --gpus-per-task=1 leaves each rank one visible GPU, and
every step's --cpu-bind pins its cores. What is left to the task: a rollout rank takes its tensor-parallel block of
the GPUs Slurm gave its step (rank 0, the scheduler, takes none), and on a site without GRES (launch.gpu_gres:
false) every GPU role takes its GPUs by SLURM_LOCALID. Only tasks started by the run's launcher (RSTAR_BIND=1, set
by roles.role_env) are touched: a command started by hand keeps its environment.
"""
from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

from rstar_hpc.exchange.placement import record_placement, task_local_rank, task_rank
from rstar_hpc.exchange.rundir import RunPaths

log = logging.getLogger("rstar_hpc.launch")


def _visible(env: MutableMapping[str, str], gpus_per_node: int) -> list[str]:
    """The GPUs this task may choose from: what Slurm made visible to the step, else all of the node's."""
    given = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return given or [str(i) for i in range(gpus_per_node)]


def task_gpus(cfg, role: str, env: MutableMapping[str, str]) -> list[str] | None:
    """The GPU ids this task should see; None: leave CUDA_VISIBLE_DEVICES as it is."""
    res = getattr(cfg.launch, role)
    if role == "sandbox" or not res.gpus_per_node:
        return None
    visible, local = _visible(env, res.gpus_per_node), task_local_rank(env)
    if role == "trainer":
        if len(visible) == 1:
            return None   # Slurm gave this rank its GPU (--gpus-per-task=1)
        return [visible[local % len(visible)]]
    if task_rank(env) == 0:
        return []   # the scheduler drives no engine
    tp = cfg.rollout.engine.tensor_parallel_size
    # on node 0, rank 0 comes first (placement.hostfile_lines): the node's engines are local ranks 1..
    node = int(env.get("SLURM_NODEID", "0") or 0) if "OMPI_COMM_WORLD_LOCAL_RANK" not in env else 0
    engine = local - 1 if node == 0 else local
    block = visible[engine * tp:(engine + 1) * tp]
    if len(block) < tp:
        raise RuntimeError(f"rollout rank {task_rank(env)} (engine {engine} of its node) needs {tp} GPUs, but the "
                           f"step sees {len(visible)} ({','.join(visible) or 'none'}); check launch.rollout."
                           f"gpus_per_node/tasks_per_node against `rstar-hpc launch CONFIG --dry-run`")
    return block


def bind(cfg, role: str, run_dir: str | os.PathLike | None = None,
         env: MutableMapping[str, str] | None = None) -> dict | None:
    """Set this task's CUDA_VISIBLE_DEVICES from the placement and record what it got under RUN/placement/;
    returns the record (None when the task was not started by the run's launcher)."""
    env = os.environ if env is None else env
    if env.get("RSTAR_BIND") != "1":
        return None
    gpus = task_gpus(cfg, role, env)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    record = record_placement(RunPaths(run_dir or cfg.run.dir), role)
    log.info("%s rank %d on %s: CUDA_VISIBLE_DEVICES=%s, %d CPUs", role, record["rank"], record["node"] or
             record["host"], record["cuda_visible_devices"], record["cpus"])
    return record
