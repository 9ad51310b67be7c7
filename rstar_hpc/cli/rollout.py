"""`rstar-hpc rollout`: run rollout steps (one vLLM engine per MPI rank besides the scheduler's rank 0).

Under an MPI launcher (sbatch/rollout.sbatch runs jobs/rollout.py, this command, under mpirun or srun) every rank
runs its part; started by hand, the command starts `mpirun` on this node itself, with a progress bar.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import click

from rstar_hpc.config.loader import DEFAULT_CONFIG

_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK")


@click.command("rollout")
@click.option("--config", "config", default=DEFAULT_CONFIG, show_default=True, help="Config name or YAML path.")
@click.option("--step", "steps", type=int, multiple=True, required=True, help="Step to run (repeatable).")
@click.option("--stage", default=None, help="Stage name [the first rl stage].")
@click.option("--engines", default=2, show_default=True, help="Engine ranks to start (when not already under MPI).")
@click.option("--sandbox", multiple=True, help="HOST:PORT of a sandbox service [the run directory's].")
@click.option("--mpirun", default="mpirun", show_default=True, help="MPI launcher used outside an MPI job.")
@click.option("--progress", is_flag=True, help="Progress bar on rank 0 [on when this command starts mpirun].")
@click.argument("overrides", nargs=-1)
def command(config, steps, stage, engines, sandbox, mpirun, progress, overrides) -> None:
    """Generate STEP's trajectories with the rollout role and commit them to the run directory.

    Under srun/mpirun each rank runs its part directly; otherwise this starts `mpirun -n ENGINES+1` on this
    node. OVERRIDES are dotted key=value pairs. Prints one JSON summary line per step.
    """
    from rstar_hpc.config import load_config
    from rstar_hpc.rollout.job import pick_stage

    if any(k in os.environ for k in _MPI_ENV):
        from rstar_hpc.logs import init_logging
        from rstar_hpc.rollout.job import run
        from rstar_hpc.rollout.mpi import env_rank

        init_logging("rollout", env_rank())
        cfg = load_config(config, list(overrides))
        run(cfg, pick_stage(cfg, stage), steps, sandbox=sandbox, progress=progress)
        return
    if engines < 1:
        raise click.BadParameter("need at least one engine rank", param_hint="--engines")
    if shutil.which(mpirun) is None:
        raise click.ClickException(f"{mpirun!r} not found: install Open MPI (or run under srun --mpi=pmix)")
    from rstar_hpc.datasets import load_prompts
    from rstar_hpc.models.resolve import resolve_model
    cfg = load_config(config, list(overrides))
    load_prompts(cfg.stage(pick_stage(cfg, stage)), cfg.run.seed)   # bad data fails here, before any rank starts
    resolve_model(cfg)                                              # fail (or build the tiny model) likewise
    cmd = [mpirun, "-n", str(engines + 1), "--oversubscribe", "--bind-to", "none",
           "--mca", "orte_enable_recovery", "1", "--mca", "orte_abort_on_non_zero_status", "0"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    rank_args = ["--config", config, *(a for s in steps for a in ("--step", str(s))),
                 *(["--stage", stage] if stage else []), *(a for s in sandbox for a in ("--sandbox", s)),
                 "--progress", *overrides]
    cmd += [sys.executable, "-m", "rstar_hpc", "rollout", *rank_args]
    rc = subprocess.call(cmd)
    if rc:
        raise SystemExit(rc)
