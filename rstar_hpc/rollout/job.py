"""The rollout role's process entry: one MPI rank of a rollout step (rank 0 schedules, ranks 1.. run engines).

Launched by sbatch/rollout.sbatch (`srun --mpi=pmix` or `mpirun`), by `rstar-hpc rollout` (which starts
mpirun itself), or directly: `mpirun -n 3 python jobs/rollout.py --config tiny-cpu --step 0`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time

from rstar_hpc.rollout.scheduler import env_rank

log = logging.getLogger("rstar_hpc.rollout")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="rollout-rank", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny-cpu")
    ap.add_argument("--stage", default=None, help="stage name (default: the first rl stage)")
    ap.add_argument("--step", type=int, action="append", required=True, help="step to run (repeatable)")
    ap.add_argument("--sandbox", action="append", default=[], help="HOST:PORT of a sandbox service (default: "
                    "the run directory's announcements)")
    ap.add_argument("--progress", action="store_true", help="progress bar on rank 0")
    ap.add_argument("overrides", nargs="*")
    return ap.parse_args(argv)


def pick_stage(cfg, name: str | None) -> str:
    if name:
        cfg.stage(name)
        return name
    for s in cfg.stages:
        if s.kind == "rl":
            return s.name
    raise ValueError("no rl stage in the config; pass --stage")


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rollout[{env_rank()}] %(levelname)s %(message)s")
    from rstar_hpc.config import load_config, prepare_run_dir
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.models.resolve import resolve_model

    cfg = load_config(args.config, list(args.overrides))
    stage = pick_stage(cfg, args.stage)
    paths = RunPaths(cfg.run.dir)
    rank = env_rank()
    if rank == 0:
        prepare_run_dir(cfg)
        model_dir = resolve_model(cfg)
    else:
        model_dir = _wait_for_model(cfg)
    if rank == 0:
        code, end = _scheduler(cfg, paths, stage, args, model_dir)
    else:
        code, end = _engine(cfg, paths, stage, args, model_dir, rank)
    sys.stdout.flush()
    sys.stderr.flush()
    if end != "exit":
        from mpi4py import MPI
        if end == "finalize":
            MPI.Finalize()
        else:
            # MPI_Finalize waits on every rank, a dead one too, and ranks that all leave without it can leave
            # the launcher waiting (mpirun's remote orted, a PMIx step) until the time limit. Everything is
            # committed and the survivors have shut their engines down: let the launcher end the job now.
            log.warning("a rank died during the job; its trajectories were re-run and every step is committed. "
                        "Ending the MPI job with MPI_Abort(0) (exit status 0 under mpirun)")
            MPI.COMM_WORLD.Abort(0)
    os._exit(code)


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


def _scheduler(cfg, paths, stage, args, model_dir) -> tuple[int, str]:
    from transformers import AutoTokenizer

    from rstar_hpc.rollout.scheduler import TAG_ABORT, init_mpi

    tok = AutoTokenizer.from_pretrained(model_dir)
    MPI = init_mpi()
    comm = MPI.COMM_WORLD
    try:
        return _scheduler_steps(cfg, paths, stage, args, tok, comm, MPI)
    except BaseException as e:
        # engine ranks would otherwise wait for work until their timeout: tell them, then fail
        log.exception("rank 0 failed")
        reqs = [comm.isend(f"{type(e).__name__}: {e}", dest=r, tag=TAG_ABORT) for r in range(1, comm.Get_size())]
        deadline = time.monotonic() + 5.0
        while not all(r.Test() for r in reqs) and time.monotonic() < deadline:
            time.sleep(0.01)
        return 1, "exit"


def _scheduler_steps(cfg, paths, stage, args, tok, comm, MPI) -> tuple[int, str]:
    from rstar_hpc.datasets import load_prompts
    from rstar_hpc.rollout.scheduler import TAG_BYE, TAG_EXIT, run_scheduler, step_items

    rows = load_prompts(cfg.stage(stage), seed=cfg.run.seed)   # once for the job, not once per step
    dead: set[int] = set()
    for step in args.step:
        items, dropped = step_items(cfg, stage, step, tok, rows)
        bar = None
        if args.progress:
            from tqdm import tqdm
            bar = tqdm(total=len(items), desc=f"rollout step {step}", unit="traj", file=sys.stderr)
        summary = run_scheduler(comm, MPI, cfg, paths, stage, step, items, dropped=dropped,
                                progress=bar.update if bar else None, dead_ranks=dead)
        if bar:
            bar.close()
        print(json.dumps(summary), flush=True)
    # the job is over: every rank finalizes MPI together; after a death the survivors shut their engines
    # down and say bye, then rank 0 ends the MPI job (main)
    survivors = [e for e in range(1, comm.Get_size()) if e not in dead]
    reqs = [comm.isend({"finalize": not dead}, dest=e, tag=TAG_EXIT) for e in survivors]
    deadline = time.monotonic() + cfg.rollout.scheduler.engine_timeout_s
    while not all(r.Test() for r in reqs) and time.monotonic() < deadline:
        time.sleep(0.01)
    if not dead:
        return 0, "finalize"
    waiting, st = set(survivors), MPI.Status()
    deadline = time.monotonic() + cfg.rollout.scheduler.engine_timeout_s
    while waiting and time.monotonic() < deadline:
        if comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_BYE, status=st):
            comm.recv(source=st.Get_source(), tag=TAG_BYE)
            waiting.discard(st.Get_source())
        else:
            time.sleep(0.01)
    if waiting:
        log.error("engine ranks %s did not confirm their shutdown; ending the job without them", sorted(waiting))
    return 0, "abort"


def _engine(cfg, paths, stage, args, model_dir, rank) -> tuple[int, str]:
    from rstar_hpc.rollout.engine import VLLMEngine

    engine = VLLMEngine(cfg, model_dir, seed=cfg.run.seed * 1000 + rank)   # before MPI (kv-balancing.md §4.6)
    from rstar_hpc.rollout.scheduler import TAG_BYE, TAG_EXIT, init_mpi, recv_from_rank0, run_engine_rank
    MPI = init_mpi()
    comm = MPI.COMM_WORLD
    from sandbox.client import SandboxClient

    async def steps() -> bool:
        client = SandboxClient(addresses=args.sandbox or None, run_dir=None if args.sandbox else str(paths.dir))
        try:
            for step in args.step:   # rank 0 names the policy each step runs; the engine loads it in place
                await run_engine_rank(comm, MPI, cfg, engine, client, stage, step)
        finally:
            await client.close()
        tag, msg = await recv_from_rank0(comm, MPI, cfg.rollout.scheduler.engine_timeout_s, "the end of the job")
        return tag == TAG_EXIT and bool(msg["finalize"])

    try:
        finalize = asyncio.run(steps())
    except RuntimeError:
        log.exception("engine rank %d failed", rank)
        return 1, "exit"
    finally:
        engine.shutdown()
    if finalize:
        return 0, "finalize"
    bye = comm.isend(None, dest=0, tag=TAG_BYE)   # rank 0 ends the job (MPI_Abort) once every survivor is down
    deadline = time.monotonic() + 10.0
    while not bye.Test() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(cfg.rollout.scheduler.engine_timeout_s)   # the abort ends this process; exit on our own if not
    return 0, "exit"


if __name__ == "__main__":
    main()
