"""`rstar-hpc rollout`: run rollout steps (one vLLM engine per rank besides the scheduler's rank 0).

The command is the ranks' keeper (rollout/keeper.py): under an srun step of one task per rank it keeps its task's
rank, otherwise it starts every rank on this node itself, with a progress bar. A rank is this command again, run
by its keeper (RSTAR_ROLLOUT_RANK set). With launch.mpi.start=world each task of the srun step is its rank itself,
one MPI world, with no keeper.
"""
from __future__ import annotations

import logging
import os
import sys

import click

from rstar_hpc.config.loader import DEFAULT_CONFIG


@click.command("rollout")
@click.option("--config", "config", default=DEFAULT_CONFIG, show_default=True, help="Config name or YAML path.")
@click.option("--step", "steps", type=int, multiple=True, help="Step of --stage (default: the first rl stage) to run "
              "(repeatable) [every one not committed yet].")
@click.option("--stage", default=None, help="Run only this rollout stage [every rollout stage of the run, in order: "
              "the stage driver's walk].")
@click.option("--engines", default=2, show_default=True, help="Engine ranks to start (when not one srun task per "
              "rank).")
@click.option("--sandbox", multiple=True, help="HOST:PORT of a sandbox service [the run directory's].")
@click.option("--progress", is_flag=True, help="Progress bar on rank 0 [on when this command starts every rank].")
@click.argument("overrides", nargs=-1)
def command(config, steps, stage: str | None, engines, sandbox, progress, overrides) -> None:
    """The rollout role: generate trajectories and commit them to the run directory.

    Without --stage it follows the run: every rl, hard_subset and eval stage in order, each step waiting for the
    policy it needs (rstar_hpc.pipeline), skipping what is committed already, so a restarted job goes on where
    the last one stopped. Under srun with one task per rank each task runs its rank; otherwise this starts
    ENGINES+1 ranks on this node. An engine rank that dies is started again (launch.rollout.engine_restarts) while
    the others go on. OVERRIDES are dotted key=value pairs. Prints one JSON summary line per step.
    """
    from rstar_hpc.cli.exit_codes import refusing
    from rstar_hpc.config import load_config
    from rstar_hpc.rollout.links import RANK_ENV

    with refusing("rollout"):
        cfg = load_config(config, list(overrides))
    if steps and not stage:   # steps of the first rl stage, as before stages were walked
        stage = next((s.name for s in cfg.stages if s.kind == "rl"), None)
        if stage is None:
            raise click.BadParameter("--step needs --stage (the config has no rl stage)", param_hint="--step")
    if cfg.launch.mpi.start == "world" and RANK_ENV not in os.environ:
        _as_world_rank(cfg)   # a task of one MPI world: its rank is its task's, and there is no keeper
    if RANK_ENV in os.environ:   # a rank, started by its keeper or as a task of one MPI world
        from rstar_hpc.launch.binding import bind
        from rstar_hpc.logs import init_logging
        from rstar_hpc.rollout.job import run

        init_logging("rollout", int(os.environ[RANK_ENV]))
        if int(os.environ[RANK_ENV]) == 0:
            with refusing("rollout"):   # under srun no keeper read it before the ranks started
                check_rollout_data(cfg, stage)
        bind(cfg, "rollout")   # before vLLM sees CUDA: this rank's tensor-parallel block, none for rank 0
        run(cfg, stage, list(steps) or None, sandbox=sandbox, progress=progress)
        return
    if engines < 1:
        raise click.BadParameter("need at least one engine rank", param_hint="--engines")
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.logs import init_logging
    from rstar_hpc.rollout.keeper import Keeper, task_ranks
    from rstar_hpc.rollout.links import node_interfaces
    from rstar_hpc.rollout.progress import TTY_ENV

    ranks, size, session = task_ranks(engines)
    init_logging("rollout-keeper", ranks[0] if len(ranks) == 1 else 0)
    local = len(ranks) > 1
    env = dict(os.environ)
    if local:
        from rstar_hpc.launch.roles import local_ranks_env
        env = local_ranks_env(env)   # inside a Slurm task, the ranks are not its tasks   # one keeper for every rank: it checks what would fail them all, and rank 0 shows a bar
        from rstar_hpc.models.resolve import resolve_model
        with refusing("rollout"):
            check_rollout_data(cfg, stage)   # bad data fails here, before any rank starts
            resolve_model(cfg)               # fail (or build the tiny model) likewise
        env[TTY_ENV] = "1" if sys.stderr.isatty() else "0"
        progress = True
    rank_args = ["--config", config, *(a for s in steps for a in ("--step", str(s))),
                 *(["--stage", stage] if stage else []), *(a for s in sandbox for a in ("--sandbox", s)),
                 *(["--progress"] if progress else []), *overrides]
    interfaces = node_interfaces(cfg.launch.mpi.interfaces, env)
    if interfaces:
        logging.getLogger("rstar_hpc.rollout").info("the rollout's ranks talk over %s (launch.mpi.interfaces%s)", ", ".join(interfaces),
                 "" if cfg.launch.mpi.interfaces else ": empty, so the one holding this node's Slurm address")
    keeper = Keeper(RunPaths(cfg.run.dir), [sys.executable, "-m", "rstar_hpc", "rollout", *rank_args], ranks, size,
                    session, engine_restarts=cfg.launch.rollout.engine_restarts, env=env, interfaces=interfaces)
    rc = keeper.run()
    if rc:
        raise SystemExit(rc)


def _as_world_rank(cfg) -> None:
    """launch.mpi.start=world: this task is rank SLURM_PROCID of one MPI world that srun started (--mpi=pmix); the
    environment a keeper would have given it, from its task's."""
    from rstar_hpc.rollout.links import LOCAL_RANK_ENV, RANK_ENV, SESSION_ENV, SIZE_ENV, node_interfaces

    env = os.environ
    if int(env.get("SLURM_STEP_NUM_TASKS", "1") or 1) < 2 or "SLURM_PROCID" not in env:
        raise click.UsageError("launch.mpi.start=world runs each rollout rank as a task of one srun step (`srun "
                               "--mpi=pmix --ntasks=<engines + 1> rstar-hpc rollout ...`, as `rstar-hpc launch` "
                               "does); started otherwise, set launch.mpi.start=tasks")
    env.update({RANK_ENV: env["SLURM_PROCID"], SIZE_ENV: env["SLURM_STEP_NUM_TASKS"],
                LOCAL_RANK_ENV: env.get("SLURM_LOCALID", "0"),
                SESSION_ENV: f"{env.get('SLURM_JOB_ID', 'job')}.r{env.get('SLURM_RESTART_COUNT', 0)}."
                             f"{env.get('SLURM_STEP_ID', 0)}"})
    interfaces = node_interfaces(cfg.launch.mpi.interfaces, env)
    if interfaces:   # a multi-homed node must not publish an address the other nodes cannot reach
        env.setdefault("OMPI_MCA_btl_tcp_if_include", ",".join(interfaces))
    if os.getpgid(0) != os.getpid():
        # a group of its own, as a keeper gives its ranks: what the rank leaves (vLLM's engine core) dies with it
        # (parentage.group_dies_with_me); a task SIGKILLed alone left its engine core running, which Slurm's
        # proctrack/linuxproc no longer counts once it is reparented
        os.setpgid(0, 0)


def check_rollout_data(cfg, stage: str | None) -> None:
    """Read the prompts of the rollout stages (or `stage`) now: a bad file is an error before any engine starts.
    A stage reading an earlier hard_subset's output is checked when it starts (the file does not exist yet)."""
    from rstar_hpc import pipeline
    for s in pipeline.rollout_stages(cfg, stage):
        if not (s.data or "").startswith("@"):
            pipeline.stage_prompts(cfg, s)
