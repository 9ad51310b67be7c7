"""The commands that start each role of a run, the same under every launcher: each role walks the run's stages
itself (rstar_hpc.pipeline), so a launcher only starts them and starts them again.

    trainer  rstar-hpc train RUN/config.yaml --follow         every sft and rl stage, in order
    rollout  rstar-hpc rollout --config RUN/config.yaml        every rl, hard_subset and eval stage (MPI ranks)
    sandbox  rstar-hpc sandbox serve --run-dir RUN ...         until the job ends (or the run is done)

Roles read the run's resolved config (RUN/config.yaml, written at launch), so a requeued job runs exactly what
was launched, overrides included.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rstar_hpc import pipeline
from rstar_hpc.cli.exit_codes import REFUSED_RUN_ENV
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.launch import container

ROLES = ("trainer", "rollout", "sandbox")


def python_of(cfg) -> str:
    return cfg.launch.python or sys.executable


def role_argv(cfg, role: str, run_dir: str | Path) -> list[str]:
    """`python -m rstar_hpc ...` of a role (without the launcher's srun/mpirun around it), with the role's image's
    python when it runs in a container."""
    config = str(Path(run_dir) / "config.yaml")
    base = [container.python(cfg, role) or python_of(cfg), "-m", "rstar_hpc"]
    if role == "trainer":
        return [*base, "train", config, "--follow"]
    if role == "rollout":
        return [*base, "rollout", "--config", config]
    if role == "sandbox":
        return [*base, "sandbox", "serve", "--run-dir", str(run_dir), "--config", config]
    raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")


def roles_needed(cfg) -> list[str]:
    """The roles a run's stages need: the trainer for sft/rl, the rollout (and its sandbox) for rl/hard_subset/eval."""
    kinds = {s.kind for s in cfg.stages}
    need = []
    if kinds & set(pipeline.TRAINER_KINDS):
        need.append("trainer")
    if kinds & set(pipeline.ROLLOUT_KINDS):
        need += ["rollout", "sandbox"]
    return need


def role_done(cfg, paths: RunPaths, role: str) -> bool:
    """Whether a role has nothing left in the run (the sandbox is done when the rollout is)."""
    if role == "trainer":
        return all(pipeline.stage_done(paths, s.name) for s in cfg.stages if s.kind in pipeline.TRAINER_KINDS)
    return all(pipeline.rollout_done(cfg, paths, s.name) for s in cfg.stages if s.kind in pipeline.ROLLOUT_KINDS)


def run_done(cfg, paths: RunPaths) -> bool:
    return role_done(cfg, paths, "trainer") and role_done(cfg, paths, "rollout")


def hostnames(nodelist: str) -> list[str]:
    """A Slurm node list ("gpu[1-3]") expanded, in Slurm's order."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    return out.stdout.split() or [nodelist.split(",")[0]]


def first_host(nodelist: str) -> str:
    return hostnames(nodelist)[0]


def node_addr(node: str) -> str:
    """The address slurmd of `node` is reached at (NodeAddr: a node's name need not resolve), else the name."""
    out = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True, timeout=30).stdout
    for token in out.split():
        if token.startswith("NodeAddr="):
            return token.split("=", 1)[1]
    return node


def role_env(cfg, role: str, nodelist: str | None, attempt: int, env=None) -> dict[str, str]:
    """A role's environment under Slurm. The trainer's torch.distributed rendezvous goes on its first node, on a
    port of this job and attempt (a restart never meets the old one's socket; RSTAR_MASTER_PORT pins it); a
    torchrun-style RANK leaked from the submit shell would win over srun's SLURM_PROCID, so it goes."""
    env = {k: v for k, v in (os.environ if env is None else env).items() if k not in ("RANK", "WORLD_SIZE",
                                                                                       "LOCAL_RANK")}
    if role == "trainer":
        env.setdefault("MASTER_ADDR", node_addr(first_host(nodelist)) if nodelist else "127.0.0.1")
        job = int(env.get("SLURM_JOB_ID", "0") or 0)
        env["MASTER_PORT"] = env.get("RSTAR_MASTER_PORT") or str(20000 + (job * 7 + attempt) % 20000)
    if not getattr(cfg.launch, role).gpus_per_node:
        env.pop("CUDA_VISIBLE_DEVICES", None)   # the batch step's GPUs are not this GPU-less step's
    env.setdefault("OMP_NUM_THREADS", str(getattr(cfg.launch, role).cpus_per_task))
    env["RSTAR_BIND"] = "1"   # the role binds itself to its GPUs from the placement (launch/binding.py)
    env[REFUSED_RUN_ENV] = str(cfg.run.dir)   # where a role that refuses its inputs says so (cli/exit_codes.py)
    return env


_SLURM_MPI_VARS = ("SLURM_", "PMIX_", "PMI_", "OMPI_")


def local_ranks_env(env) -> dict[str, str]:
    """The environment of a rollout that starts every rank itself inside a Slurm task (launch.mpi=none, or
    submitit's one-node rollout): without Slurm's task and MPI variables, else its keeper would take them for one
    task per rank (rollout/keeper.py), and a rank's MPI for a launch by srun. The job id stays, renamed, for the
    ranks' placement records."""
    out = {k: v for k, v in env.items() if not k.startswith(_SLURM_MPI_VARS)}
    if "SLURM_JOB_ID" in env:
        out["RSTAR_SLURM_JOB_ID"] = env["SLURM_JOB_ID"]
    return out
