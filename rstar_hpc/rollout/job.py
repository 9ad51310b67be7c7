"""The rollout role's job: one MPI rank of one or more rollout steps (rank 0 schedules, ranks 1.. run engines).

`run(cfg, stage, steps)` is what every rank of the MPI job calls; `rstar-hpc rollout` parses the command line and
calls it when it runs under an MPI launcher (sbatch/rollout.sbatch: `mpirun python -m rstar_hpc rollout ...`), or
starts mpirun on this node itself otherwise.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

from rstar_hpc.rollout.links import RANK_ENV
from rstar_hpc.rollout.mpi import TAG_ABORT, TAG_EXIT, finalize_world, init_mpi, recv_from_rank0, wait_sent
from rstar_hpc.rollout.engines import JobEngines

log = logging.getLogger("rstar_hpc.rollout")


def run(cfg, stage: str | None = None, steps: Sequence[int] | None = None, *, sandbox: Sequence[str] = (),
        progress: bool = False) -> NoReturn:
    """This rank's part of the rollout: with no `stage`, every rollout stage of the run in order (what is not done
    yet: the stage driver's walk, rstar_hpc.pipeline), else `steps` of `stage` (default: its uncommitted ones).
    Ends the process (os._exit) with the job's outcome. `sandbox`: HOST:PORT of sandbox services (default: the run
    directory's announcements); `progress`: a bar on rank 0 when a terminal shows it (else progress log lines)."""
    from rstar_hpc.cli.exit_codes import refusing
    from rstar_hpc.config import prepare_run_dir
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.models.resolve import resolve_model

    paths = RunPaths(cfg.run.dir)
    rank = int(os.environ.get(RANK_ENV, 0))
    _catch_stop_signals(rank)
    if rank == 0:
        with refusing("rollout"):
            prepare_run_dir(cfg)
            model_dir = resolve_model(cfg)
    else:
        model_dir = _wait_for_model(cfg)
    if rank == 0:
        code = _scheduler(cfg, paths, stage, steps, progress, model_dir)
    else:
        code = _engine(cfg, paths, stage, sandbox, model_dir, rank)
    from rstar_hpc.metrics_log import close_all
    close_all()   # os._exit below skips atexit
    sys.stdout.flush()
    sys.stderr.flush()
    if cfg.launch.mpi.start == "world":
        finalize_world(code)
    # joined ranks: no MPI_Finalize (collective over every process ever connected, a dead engine too); nothing pends
    os._exit(code)


EXIT_REQUEUE = 75   # stopped by a signal with the work so far committed: run again to continue
_STOP: list[str] = []


def _catch_stop_signals(rank: int) -> None:
    """USR2 (Slurm's pre-timeout signal) and TERM (preemption, `scancel --signal=TERM`): rank 0 commits the step's
    finished trajectories to its journal and ends the job; engine ranks wait for its word (USR2 would kill them)."""
    import signal

    def stop(signum, frame):
        _STOP.append(signal.Signals(signum).name)
    signal.signal(signal.SIGUSR2, stop if rank == 0 else signal.SIG_IGN)
    if rank == 0:
        signal.signal(signal.SIGTERM, stop)


def _wait_for_model(cfg, timeout_s: float = 600.0):
    """Rank 0 builds a tiny model; the others wait for it instead of racing to build it too."""

    from rstar_hpc.models.resolve import ModelNotFoundError, resolve_model

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return resolve_model(cfg, build=False)
        except ModelNotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def _scheduler(cfg, paths, stage: str | None, steps, progress, model_dir) -> int:
    from transformers import AutoTokenizer

    from rstar_hpc.rollout.links import RankZeroLinks, Session, WorldLinks, mpi_name
    from rstar_hpc.rollout.scheduler import StopRequested

    tok = AutoTokenizer.from_pretrained(model_dir)
    MPI = init_mpi()
    if cfg.launch.mpi.start == "world":
        comm = WorldLinks(MPI)
        log.info("the rollout's %d ranks are one MPI world (%s): an engine's death ends the role's step",
                 comm.Get_size(), mpi_name(MPI.Get_library_version()))
    else:
        comm = RankZeroLinks(MPI, Session.from_env(paths))
    try:
        return RolloutJob(cfg, paths, comm, MPI, tok, explicit_steps=steps).run(stage, progress)
    except StopRequested as e:
        log.warning("%s; %s", e, "ending the role for its supervisor to start again" if
                    getattr(comm, "restart_wanted", None) else "ending the job, run again to continue")
        wait_sent([comm.isend(str(e), dest=r, tag=TAG_ABORT) for r in range(1, comm.Get_size())], 5.0)
        return EXIT_REQUEUE
    except BaseException as e:
        # engine ranks would otherwise wait for work until their timeout: tell them, then fail
        log.exception("rank 0 failed")
        wait_sent([comm.isend(f"{type(e).__name__}: {e}", dest=r, tag=TAG_ABORT) for r in range(1, comm.Get_size())],
                  5.0)
        return 1


class RolloutJob:
    """Rank 0's job: what lives for the whole job (MPI, the run, the tokenizer, the scorer, the engine ranks lost so
    far and the policy each engine runs), the walk over its stages, and each step run by a StepScheduler.
    `explicit_steps`: the steps the command line named (a requeue may not take steps back then)."""

    def __init__(self, cfg, paths, comm, MPI, tokenizer, *, explicit_steps: Sequence[int] | None = None):
        from rstar_hpc.rollout.step import Scorer

        self.cfg, self.paths, self.comm, self.MPI, self.tok = cfg, paths, comm, MPI, tokenizer
        self.explicit_steps = explicit_steps
        self.score = Scorer(cfg.run.name, cfg.algo.reward, cfg.algo.roc)
        self.engines = JobEngines()                    # lost ranks, their policy versions, loads still running

    def run(self, stage: str | None, progress: bool) -> int:
        """Every rollout stage asked for (all of the run's with no `stage`), then the job's end."""
        from rstar_hpc import pipeline
        from rstar_hpc.exchange.state import write_heartbeat

        self.wait_for_engines()
        for name in [s.name for s in pipeline.rollout_stages(self.cfg, stage)]:
            if stage is None and pipeline.rollout_done(self.cfg, self.paths, name):
                continue
            self.run_stage(name, progress)
        write_heartbeat(self.paths, "rollout", "done: every rollout stage asked for is committed")
        return _end_job(self.comm, self.cfg.rollout.scheduler)

    def wait_for_engines(self) -> None:
        """The engine ranks build their engines, then join; one that does not join in time is left out until it
        does (refresh_engines)."""
        from rstar_hpc.exchange.state import write_heartbeat

        sc, size = self.cfg.rollout.scheduler, self.comm.Get_size()
        deadline = time.monotonic() + sc.policy_load_timeout_s + sc.engine_timeout_s
        missing = list(range(1, size))
        while missing and time.monotonic() < deadline and not _STOP:
            write_heartbeat(self.paths, "rollout", f"starting: {size - 1 - len(missing)} of {size - 1} engine ranks "
                            f"joined", phase="start_engines")
            missing = self.comm.wait_joined(min(10.0, max(0.0, deadline - time.monotonic())))
        self.comm.take_joined()
        if missing:
            log.error("engine ranks %s did not join in %.0fs; the job starts without them", missing,
                      sc.policy_load_timeout_s + sc.engine_timeout_s)
            self.engines.dead.update(missing)

    def refresh_engines(self, stage: str, step: int) -> None:
        """Before a step: an engine lost earlier that joined again takes part; one whose process died since the
        last step does not."""
        from rstar_hpc.exchange.events import record_event

        for e in self.comm.take_joined():
            self.engines.versions.pop(e, None)   # a new process: it holds no policy yet, loads nothing
            self.engines.loading.pop(e, None)
            if e in self.engines.dead:
                self.engines.dead.discard(e)
                log.info("engine rank %d is back (pid %d): it takes part from step %d", e, self.comm.pids[e], step)
                record_event(self.paths, "engine_back", role="rollout", rank=e, pid=self.comm.pids[e], stage=stage,
                             step=step)
        for e in sorted(self.comm.down() - self.engines.dead):
            log.error("engine rank %d died between steps; step %d runs without it", e, step)
            record_event(self.paths, "engine_lost", role="rollout", rank=e, stage=stage, step=step, requeued=0,
                         reason="its process ended between steps")
            self.engines.dead.add(e)

    def run_stage(self, name: str, progress: bool) -> None:
        from rstar_hpc import pipeline
        from rstar_hpc.exchange.state import write_heartbeat
        from rstar_hpc.rollout.policy_source import StepGivesWay
        from rstar_hpc.rollout.progress import TTY_ENV, StageProgress, stage_problem_counts
        from rstar_hpc.rollout.step import StepSpec
        from rstar_hpc.rollout.tasks import finish_stage, stage_steps
        from rstar_hpc.rollout.validation import val_prompts, validate_due

        cfg, paths, steps = self.cfg, self.paths, self.explicit_steps
        write_heartbeat(paths, "rollout", f"stage {name}: reading its prompts", stage=name)
        # a bar where someone watches (the local launcher says whether its stderr is a terminal), else log lines
        bar = StageProgress(name, *stage_problem_counts(cfg, paths, name),
                            tty=progress and (sys.stderr.isatty() or os.environ.get(TTY_ENV) == "1"))
        kind = cfg.stage(name).kind
        last = pipeline.rollout_steps(cfg.stage(name)) - 1 if kind == "rl" else None
        if pipeline.val_points(cfg.stage(name)):
            val_prompts(cfg, cfg.stage(name))   # an unreadable val_data file fails the job now, not after step 0
        for task in stage_steps(cfg, paths, name, self.tok, steps=steps):
            bar.start_step(task.items)
            write_heartbeat(paths, "rollout", f"step {task.step} of stage {name}: starting", stage=name,
                            step=task.step, phase="start_step")
            try:
                spec = StepSpec(name, task.step, task.items, task.limits, task.need, task.dropped)
                print(json.dumps(self.run_step(spec, name, bar)), flush=True)
                write_heartbeat(paths, "rollout", f"step {task.step} of stage {name}: committed", stage=name,
                                step=task.step)
                if kind == "rl":   # the points up to this step; after the last one, the final policy's too
                    validate_due(cfg, paths, name, task.step + (task.step == last), self.tok,
                                 lambda s: self.run_step(s, name))
            except StepGivesWay as e:   # the stage walk comes back to this step after the taken-back one
                log.warning("%s", e)
        bar.close()
        if kind == "rl" and steps is None:   # points a requeue left behind, with every step committed already
            validate_due(cfg, paths, name, last + 1, self.tok, lambda s: self.run_step(s, name))
        if steps is None:
            out = finish_stage(cfg, paths, name)
            if out is not None:
                log.info("stage %s done: %s", name, out.get("summary", ""))

    def run_step(self, spec, stage_name: str, progress=None) -> dict:
        """One step of stage `stage_name` (spec.stage is it, or its validation pseudo-stage); its summary. Only an
        rl stage's own steps may carry work on (partial rollouts)."""
        from rstar_hpc import pipeline
        from rstar_hpc.exchange.state import write_heartbeat
        from rstar_hpc.rollout.scheduler import StepScheduler
        from rstar_hpc.rollout.step import StepHooks

        cfg, paths = self.cfg, self.paths
        sc = cfg.rollout.scheduler
        self.refresh_engines(spec.stage, spec.step)
        if spec.stage != stage_name or cfg.stage(stage_name).kind != "rl":
            sc = sc.model_copy(update={"partial_rollouts": False})
        hooks = StepHooks(
            progress=progress, stop=lambda: _STOP[0] if _STOP else getattr(self.comm, "restart_wanted", None),
            beat=lambda text, **kw: write_heartbeat(paths, "rollout", text, stage=stage_name, **kw),
            taken_back=(lambda: pipeline.taken_back(cfg, paths, spec.need)) if self.explicit_steps is None else None)
        return StepScheduler(self.comm, self.MPI, sc, paths, spec, score=self.score, hooks=hooks,
                             engines=self.engines, engine_workers=cfg.rollout.engine.tensor_parallel_size).run()


def _end_job(comm, sc) -> int:
    """The job is over: EXIT to every engine rank (each shuts its engine down and leaves; the keepers see to the
    rest)."""
    engines = [e for e in range(1, comm.Get_size()) if e not in comm.down()]
    if not wait_sent([comm.isend({}, dest=e, tag=TAG_EXIT) for e in engines], sc.engine_timeout_s):
        log.warning("not every engine rank took the job's end; their keepers stop them")
    return 0


def engine_context(cfg, stage: str | None) -> int:
    """One engine serves every stage of the job (a rebuild after MPI's start crashes Open MPI's shared memory), so
    it gets the longest context of them: config validation holds each stage's prompt + response within its own."""
    from rstar_hpc import pipeline

    return max((cfg.engine_context(s) for s in pipeline.rollout_stages(cfg, stage)),
               default=cfg.rollout.engine.max_model_len)


def _engine(cfg, paths, stage: str | None, sandbox, model_dir, rank) -> int:
    from rstar_hpc.rollout.engine import VLLMEngine

    from rstar_hpc.parentage import group_dies_with_me

    group_dies_with_me()   # vLLM's engine core and workers end with this rank, however it ends (a task SIGKILLed)
    context = engine_context(cfg, stage)
    rollout = cfg.rollout.model_copy(update={"engine": cfg.rollout.engine.model_copy(update={"max_model_len": context})})
    engine = VLLMEngine(rollout, model_dir, seed=cfg.run.seed * 1000 + rank)   # before MPI: see engine_context
    from rstar_hpc.rollout.engine_rank import run_engine_rank
    from sandbox.client import SandboxClient

    from rstar_hpc.rollout.links import EngineLink, Session

    MPI = init_mpi()
    sc, agent_cfg = cfg.rollout.scheduler, cfg.rollout.agent
    comm = (EngineLink.world(MPI) if cfg.launch.mpi.start == "world" else
            EngineLink(MPI, Session.from_env(paths), timeout_s=sc.policy_load_timeout_s + sc.engine_timeout_s))

    async def run_steps() -> None:
        client = SandboxClient(addresses=list(sandbox) or None, run_dir=None if sandbox else str(paths.dir))
        try:
            # rank 0 names the stage, step, limits and policy of each step; the engine loads the policy in place
            while await run_engine_rank(comm, MPI, sc, agent_cfg, engine, client, run_seed=cfg.run.seed) is not None:
                pass
        finally:
            await client.close()
        await recv_from_rank0(comm, MPI, sc.engine_timeout_s, "the end of the job")

    try:
        asyncio.run(run_steps())
    except RuntimeError:
        log.exception("engine rank %d failed", rank)
        return 1
    finally:
        comm.flush(5.0)
        engine.shutdown()
    return 0
