"""What each task of a run really got when it started (host, GPUs, CPU affinity): one small JSON file per task,
RUN/placement/<role>-<rank>.json, rewritten at every start. `run status --json` lists it beside the planned
placement; `rstar-hpc doctor` prints the same record for the step it runs in."""
from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping

from rstar_hpc.exchange.atomic import atomic_write_json
from rstar_hpc.exchange.rundir import RunPaths

# a rollout rank's keeper names it (rollout/keeper.py); then an MPI launcher's, then srun's
RANK_VARS = ("RSTAR_ROLLOUT_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")
LOCAL_VARS = ("RSTAR_ROLLOUT_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> int:
    # an mpirun started inside a Slurm task passes the task's SLURM_* on to every rank: MPI's own variables win
    for name in names:
        if env.get(name, "").isdigit():
            return int(env[name])
    return 0


def task_rank(env: Mapping[str, str] | None = None) -> int:
    return _first(os.environ if env is None else env, RANK_VARS)


def task_local_rank(env: Mapping[str, str] | None = None) -> int:
    return _first(os.environ if env is None else env, LOCAL_VARS)


def observe(role: str, rank: int | None = None, env: Mapping[str, str] | None = None,
            devices: list[int] | None = None) -> dict:
    """This process's placement: host, Slurm node and job, the GPUs it sees (CUDA_VISIBLE_DEVICES, `visible`) and
    those it computes on (`devices`, as its binding chose them; `device`: the one of a single-GPU rank), how many
    CPUs it may run on, and its network namespace."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = [int(g) for g in visible.split(",") if g.strip().isdigit()] if visible else []
    devices = list(ids if devices is None else devices)
    return {"role": role, "rank": task_rank(env) if rank is None else rank, "local_rank": task_local_rank(env),
            "host": socket.gethostname(), "node": env.get("SLURMD_NODENAME"),
            "job": env.get("SLURM_JOB_ID") or env.get("RSTAR_SLURM_JOB_ID"),
            "step": env.get("SLURM_STEP_ID"), "cuda_visible_devices": visible, "gpus": ids, "visible": ids,
            "devices": devices, "device": devices[0] if len(devices) == 1 else None,
            "cpus": len(os.sched_getaffinity(0)), "pid": os.getpid(), "net_ns": _net_namespace(), "at": time.time()}


def _net_namespace() -> str | None:
    """The network namespace the task runs in ("net:[4026531840]"): tasks on one host share it; a container without
    a network of its own shows the host's."""
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return None


def record_placement(paths: RunPaths, role: str, rank: int | None = None, devices: list[int] | None = None) -> dict:
    record = observe(role, rank, devices=devices)
    path = paths.observed_placement(role, record["rank"])
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record)
    return record


def read_placements(paths: RunPaths) -> dict[tuple[str, int], dict]:
    """(role, rank) -> the record its task last wrote."""
    out = {}
    folder = paths.dir / "placement"
    for name in sorted(os.listdir(folder)) if folder.is_dir() else []:
        if not name.endswith(".json"):
            continue
        try:
            record = json.loads((folder / name).read_text())
            out[(record["role"], int(record["rank"]))] = record
        except (OSError, ValueError, KeyError):
            continue
    return out
