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
@click.option("--step", "steps", type=int, multiple=True, help="Step of --stage (default: the first rl stage) to run "
              "(repeatable) [every one not committed yet].")
@click.option("--stage", default=None, help="Run only this rollout stage [every rollout stage of the run, in order: "
              "the stage driver's walk].")
@click.option("--engines", default=2, show_default=True, help="Engine ranks to start (when not already under MPI).")
@click.option("--sandbox", multiple=True, help="HOST:PORT of a sandbox service [the run directory's].")
@click.option("--mpirun", default="mpirun", show_default=True, help="MPI launcher used outside an MPI job.")
@click.option("--progress", is_flag=True, help="Progress bar on rank 0 [on when this command starts mpirun].")
@click.argument("overrides", nargs=-1)
def command(config, steps, stage, engines, sandbox, mpirun, progress, overrides) -> None:
    """The rollout role: generate trajectories and commit them to the run directory.

    Without --stage it follows the run: every rl, hard_subset and eval stage in order, each step waiting for the
    policy it needs (rstar_hpc.pipeline), skipping what is committed already, so a restarted job goes on where
    the last one stopped. Under srun/mpirun each rank runs its part directly; otherwise this starts
    `mpirun -n ENGINES+1` on this node. OVERRIDES are dotted key=value pairs. Prints one JSON summary line per
    step.
    """
    from rstar_hpc.config import load_config

    if steps and not stage:   # steps of the first rl stage, as before stages were walked
        stage = next((s.name for s in load_config(config, list(overrides)).stages if s.kind == "rl"), None)
        if stage is None:
            raise click.BadParameter("--step needs --stage (the config has no rl stage)", param_hint="--step")
    if any(k in os.environ for k in _MPI_ENV):
        from rstar_hpc.logs import init_logging
        from rstar_hpc.rollout.job import run
        from rstar_hpc.rollout.mpi import env_rank

        init_logging("rollout", env_rank())
        cfg = load_config(config, list(overrides))
        from rstar_hpc.launch.binding import bind
        bind(cfg, "rollout")   # before vLLM sees CUDA: this rank's tensor-parallel block, none for rank 0
        run(cfg, stage, list(steps) or None, sandbox=sandbox, progress=progress)
        return
    if engines < 1:
        raise click.BadParameter("need at least one engine rank", param_hint="--engines")
    if shutil.which(mpirun) is None:
        raise click.ClickException(f"{mpirun!r} not found: install Open MPI (or run under srun --mpi=pmix)")
    from rstar_hpc.models.resolve import resolve_model
    cfg = load_config(config, list(overrides))
    check_rollout_data(cfg, stage)   # bad data fails here, before any rank starts
    resolve_model(cfg)               # fail (or build the tiny model) likewise
    cmd = [mpirun, "-n", str(engines + 1), "--oversubscribe", "--bind-to", "none",
           "--mca", "orte_enable_recovery", "1", "--mca", "orte_abort_on_non_zero_status", "0"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    rank_args = ["--config", config, *(a for s in steps for a in ("--step", str(s))),
                 *(["--stage", stage] if stage else []), *(a for s in sandbox for a in ("--sandbox", s)),
                 "--progress", *overrides]
    cmd += [sys.executable, "-m", "rstar_hpc", "rollout", *rank_args]
    from rstar_hpc.launch.roles import own_mpirun_env
    from rstar_hpc.rollout.progress import TTY_ENV
    rc = _run_mpirun(cmd, {**own_mpirun_env(os.environ), TTY_ENV: "1" if sys.stderr.isatty() else "0"})
    if rc:
        raise SystemExit(rc)


def _run_mpirun(cmd: list[str], env: dict) -> int:
    """mpirun, with a stop (USR2, TERM) sent to this launcher passed on as USR2, which mpirun forwards to the ranks:
    rank 0 journals the step's finished trajectories and ends the job (TERM would make mpirun kill the ranks)."""
    import signal

    proc = subprocess.Popen(cmd, env=env)

    def forward(signum, frame):
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR2)
    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGUSR2, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def check_rollout_data(cfg, stage: str | None) -> None:
    """Read the prompts of the rollout stages (or `stage`) now: a bad file is an error before any engine starts.
    A stage reading an earlier hard_subset's output is checked when it starts (the file does not exist yet)."""
    from rstar_hpc import pipeline
    for s in pipeline.rollout_stages(cfg, stage):
        if not (s.data or "").startswith("@"):
            pipeline.stage_prompts(cfg, s)
