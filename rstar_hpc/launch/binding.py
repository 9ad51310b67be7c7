"""A launched task binds itself to its GPUs (before anything touches CUDA) and records what it got.

Slurm binds what it can (placement.py): every step's --cpu-bind pins its cores, and GPU steps get their nodes' GPUs.
What is left to the task: a trainer rank keeps every GPU of its node visible (NCCL's P2P/NVLink between the ranks
of a node needs them) and computes on its local rank's (trainer/parallel.py sets the device); a rollout rank takes
its tensor-parallel block of the GPUs Slurm gave its step (rank 0, the scheduler, takes none); on a site without GRES
(launch.gpu_gres: false) the same, by SLURM_LOCALID. Only tasks started by the run's launcher (RSTAR_BIND=1, set
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
    """The GPU ids this task should see; None: leave CUDA_VISIBLE_DEVICES as it is (a trainer rank: all of its
    node's)."""
    res = getattr(cfg.launch, role)
    if role in ("sandbox", "trainer") or not res.gpus_per_node:
        return None
    visible, local = _visible(env, res.gpus_per_node), task_local_rank(env)
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


def task_devices(cfg, role: str, env: MutableMapping[str, str]) -> list[int]:
    """The GPU ids this task computes on, once bound: a trainer rank its local rank's of the GPUs it sees (the device
    trainer/parallel.py selects), an engine rank its block, the others none."""
    res = getattr(cfg.launch, role)
    if role == "sandbox" or not res.gpus_per_node:
        return []
    visible = [int(g) for g in _visible(env, res.gpus_per_node) if g.strip().isdigit()]
    if role == "trainer":
        return [visible[task_local_rank(env) % len(visible)]] if visible else []
    return [] if task_rank(env) == 0 else visible


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
    record = record_placement(RunPaths(run_dir or cfg.run.dir), role, devices=task_devices(cfg, role, env))
    log.info("%s rank %d on %s: CUDA_VISIBLE_DEVICES=%s, computes on %s, %d CPUs", role, record["rank"],
             record["node"] or record["host"], record["cuda_visible_devices"], record["devices"] or "no GPU",
             record["cpus"])
    return record
