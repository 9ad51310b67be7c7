"""One rollout step over MPI: rank 0 schedules and writes, ranks 1..N each own one vLLM engine.

    mpirun -n 3 python jobs/rollout.py --config tiny-cpu --step 0        # or srun --mpi=pmix under Slurm

Rank 0 (no engine) holds the step's trajectories in a FIFO and admits each with the shared policy
(policy.py: `kv_aware`, rStar2's, or `static`) to an engine rank, which keeps it for all its turns. Engine
ranks run every admitted trajectory as an agent-loop coroutine (agent.py) against their engine and the
sandbox service, and send each finished one back; rank 0 releases its reservation, admits more at once, scores
it (reward and RoC quality signals, off the generation path: generation goes on meanwhile), and at the end
writes all of them in ONE committed shard set (producer "rollout"). So a trajectory is written once, or, if
rank 0 dies, not at all (a rerun of the step starts clean: the commit record is the only publication).

Engine death: an engine rank that reports its engine dead, or is silent for `engine_timeout_s`, is dropped;
its unfinished trajectories go back to the front of the queue and run on the others from scratch. A late
result for a trajectory already re-run is ignored (results are keyed by (prompt_uid, sample_index)). Under
mpirun this needs `--mca orte_enable_recovery 1` (Open MPI 4) so one rank's death does not end the job.

MPI is initialised AFTER the engine is built and finalised after it is shut down (kv-balancing.md §4.6).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from rstar_hpc.rollout.policy import KVAwarePolicy, StaticPolicy, make_policy  # noqa: F401 (shared API)

log = logging.getLogger("rstar_hpc.rollout")

TAG_HELLO, TAG_WORK, TAG_RESULT, TAG_BEAT, TAG_DONE, TAG_STOP, TAG_DEAD = range(1, 8)
PRODUCER = "rollout"


@dataclass
class WorkItem:
    prompt_uid: str
    sample_index: int
    prompt_ids: list[int]
    prompt_text: str
    answer: str

    @property
    def key(self) -> tuple[str, int]:
        return (self.prompt_uid, self.sample_index)


def init_mpi():
    import mpi4py
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from mpi4py import MPI
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    return MPI


# --------------------------------------------------------------------------------------------------- step input
def step_items(cfg, stage_name: str, step: int, tokenizer) -> tuple[list[WorkItem], list[str]]:
    """The step's prompts x num_samples_per_prompt, and the uids of prompts dropped as over-long (the
    reference filters them: they cannot be trained on)."""
    from rstar_hpc.rollout.agent import PromptTooLong, encode_prompt

    stage = cfg.stage(stage_name) if cfg.stages else None
    n = stage.prompts_per_step if stage is not None else 8
    if stage is not None and stage.data:
        rows = [json.loads(line) for line in Path(stage.data).read_text().splitlines() if line.strip()]
        if not rows:
            raise ValueError(f"stage {stage_name!r}: data file {stage.data} has no prompts")
        prompts = [rows[(step * n + i) % len(rows)] for i in range(n)]
    else:
        from rstar_hpc.rollout.generate import demo_prompts
        prompts = demo_prompts(n, seed=cfg.run.seed * 1_000_003 + step)
    items, dropped = [], []
    for p in prompts:
        uid = str(p.get("uid") or p.get("id") or p["question"][:64])
        try:
            ids, text = encode_prompt(tokenizer, p["question"], cfg.rollout.agent.max_prompt_length)
        except PromptTooLong as e:
            log.warning("dropping prompt %s: %s", uid, e)
            dropped.append(uid)
            continue
        items += [WorkItem(uid, s, ids, text, str(p["answer"])) for s in range(cfg.algo.num_samples_per_prompt)]
    return items, dropped


def stage_limits(cfg, stage_name: str) -> tuple[int, int]:
    stage = cfg.stage(stage_name) if cfg.stages else None
    agent = cfg.rollout.agent
    return ((stage.max_response_length if stage and stage.max_response_length else agent.max_response_length),
            (stage.max_turns if stage and stage.max_turns else agent.max_turns))


# --------------------------------------------------------------------------------------------------- rank 0
def run_scheduler(comm, MPI, cfg, paths, stage: str, step: int, items: list[WorkItem], *, dropped=(),
                  progress=None) -> dict:
    """Rank 0: admit, collect, score, write. Returns the step's summary (also appended to metrics/rollout)."""
    from rstar_hpc.exchange.writer import ShardWriter

    sc = cfg.rollout.scheduler
    max_response, _ = stage_limits(cfg, stage)
    engines = list(range(1, comm.Get_size()))
    if not engines:
        raise RuntimeError("the rollout step needs at least 2 MPI ranks: rank 0 schedules, ranks 1.. run engines")
    if ShardWriter.is_committed(paths, stage, step, PRODUCER):
        log.info("step %d of stage %s already committed: nothing to do", step, stage)
        for e in engines:
            comm.send(None, dest=e, tag=TAG_STOP)
        return {"step": step, "skipped": True}
    t_start = time.monotonic()
    hello: dict[int, dict] = {}
    deadline = time.monotonic() + sc.engine_timeout_s
    while len(hello) < len(engines) and time.monotonic() < deadline:
        st = MPI.Status()
        if comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_HELLO, status=st):
            hello[st.Get_source()] = comm.recv(source=st.Get_source(), tag=TAG_HELLO)
        else:
            time.sleep(0.005)
    if not hello:
        raise RuntimeError(f"no engine rank started step {step} within {sc.engine_timeout_s}s")
    missing = [e for e in engines if e not in hello]
    if missing:
        log.error("engine ranks %s did not start step %d; running without them", missing, step)
    engines = sorted(hello)
    policy = make_policy(sc.policy, {e: hello[e]["capacity_tokens"] for e in engines},
                         budget_coef=sc.budget_coef, max_per_engine=sc.max_trajectories_per_engine)
    by_key = {it.key: it for it in items}
    if len(by_key) != len(items):
        raise ValueError("duplicate (prompt_uid, sample_index) in the step's prompts; uids must be unique")
    for it in items:
        policy.check_fits_somewhere(len(it.prompt_ids) + max_response)
    pending: deque = deque(items)
    queued_at = {it.key: 0.0 for it in items}
    results: dict = {}
    alive = {e: time.monotonic() for e in engines}
    dead: list[int] = list(missing)
    engine_stats: dict = {}
    reward_s = 0.0
    reruns = 0
    sends: list = []

    def lose(e: int, why: str) -> None:
        nonlocal reruns
        log.error("engine rank %d lost (%s); re-queueing its unfinished trajectories", e, why)
        alive.pop(e, None)
        dead.append(e)
        back = [k for k in policy.engine_lost(e) if k not in results]
        reruns += len(back)
        for k in reversed(back):
            pending.appendleft(by_key[k])
        if not alive:
            raise RuntimeError(f"all engine ranks died; {len(items) - len(results)} trajectories of step {step} "
                               f"unfinished, nothing written")

    while len(results) < len(items):
        # admit: FIFO, the head waits for room (rStar2: nothing jumps the queue)
        batch: dict[int, list] = {}
        while pending:
            it = pending[0]
            if it.key in results:
                pending.popleft()
                continue
            e = policy.place(it.key, len(it.prompt_ids) + max_response)
            if e is None:
                break
            pending.popleft()
            queued_at[it.key] = time.monotonic() - t_start
            batch.setdefault(e, []).append(dataclasses.asdict(it))
        # never a blocking send: a large message to a rank that just died would wait forever (rendezvous)
        for e, work in batch.items():
            sends.append(comm.isend(work, dest=e, tag=TAG_WORK))
        sends[:] = [r for r in sends if not r.Test()]
        got = False
        st = MPI.Status()
        while comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=st):
            got = True
            src, tag = st.Get_source(), st.Get_tag()
            msg = comm.recv(source=src, tag=tag)
            if src not in alive:
                continue   # a rank declared dead that was only slow: its work already runs elsewhere
            alive[src] = time.monotonic()
            if tag == TAG_RESULT:
                key = (msg["prompt_uid"], msg["sample_index"])
                if key in results or key not in by_key:
                    continue
                if policy.placed.get(key) is not None:
                    policy.release(key)
                t0 = time.perf_counter()
                results[key] = _to_trajectory(cfg, stage, step, by_key[key], msg, queued_at[key])
                reward_s += time.perf_counter() - t0
                if progress is not None:
                    progress(1)
            elif tag == TAG_DEAD:
                lose(src, msg)
        now = time.monotonic()
        for e, seen in list(alive.items()):
            if now - seen > sc.engine_timeout_s:
                lose(e, f"silent for {now - seen:.0f}s")
        if not got:
            time.sleep(0.005)
    gen_s = time.monotonic() - t_start
    for e in alive:
        sends.append(comm.isend(None, dest=e, tag=TAG_DONE))
    deadline = time.monotonic() + sc.engine_timeout_s
    while len(engine_stats) < len(alive) and time.monotonic() < deadline:
        st = MPI.Status()
        if comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_STOP, status=st):
            engine_stats[st.Get_source()] = comm.recv(source=st.Get_source(), tag=TAG_STOP)
        else:
            time.sleep(0.005)
    trajs = [results[it.key] for it in items]
    with ShardWriter(paths, stage, step, PRODUCER) as w:
        w.write(trajs)
    summary = {
        "step": step, "stage": stage, "policy": sc.policy, "trajectories": len(trajs),
        "dropped_prompts": list(dropped), "engines": engines, "dead_engines": dead, "reruns": reruns,
        "wall_s": round(time.monotonic() - t_start, 3), "generation_wall_s": round(gen_s, 3),
        "reward_s": round(reward_s, 4),
        "tool_wait_s": round(sum(t.timings.tool_s for t in trajs), 3),
        "generate_s": round(sum(t.timings.generate_s for t in trajs), 3),
        "mean_reward": sum(t.reward for t in trajs) / max(1, len(trajs)),
        "finish_reasons": {r: sum(t.finish_reason == r for t in trajs) for r in {t.finish_reason for t in trajs}},
        "engine_stats": {str(k): v for k, v in engine_stats.items()},
    }
    mpath = paths.metrics("rollout")
    mpath.parent.mkdir(parents=True, exist_ok=True)
    with open(mpath, "a") as f:
        f.write(json.dumps(summary) + "\n")
    return summary


def _to_trajectory(cfg, stage: str, step: int, it: WorkItem, msg: dict, queue_s: float):
    from rstar_hpc.algo.quality import trajectory_quality
    from rstar_hpc.algo.reward import score_response
    from rstar_hpc.exchange.schema import Timings, ToolCall, Trajectory, Turn

    turns = [Turn(**t) for t in msg["turns"]]
    calls = [ToolCall(**c) for c in msg["tool_calls"]]
    response = "".join(t.text for t in turns)
    t0 = time.perf_counter()
    if msg["finish_reason"] == "aborted":
        reward, answer = 0.0, None
    else:
        r = score_response(response, it.answer, cfg.algo.reward)
        reward, answer = float(r.score), r.answer
    q = trajectory_quality(response, [c.status for c in calls], sum(t.role == "assistant" for t in turns),
                           cfg.algo.roc)
    timings = Timings(**msg["timings"])
    timings.queue_s, timings.reward_s = queue_s, time.perf_counter() - t0
    return Trajectory(run=cfg.run.name, stage=stage, step=step, prompt_uid=it.prompt_uid,
                      sample_index=it.sample_index, policy_version=msg["policy_version"],
                      engine_rank=msg["engine_rank"], prompt_ids=it.prompt_ids, response_ids=msg["response_ids"],
                      loss_mask=msg["loss_mask"], logprobs=msg["logprobs"], turns=turns,
                      prompt_text=it.prompt_text, tool_calls=calls, finish_reason=msg["finish_reason"],
                      answer=answer, reward=reward, p_err=q.p_err, p_format=q.p_format, timings=timings).validate()


# --------------------------------------------------------------------------------------------------- ranks 1..N
async def run_engine_rank(comm, MPI, cfg, engine, tools, stage: str, step: int) -> dict:
    """An engine rank for one step: run what rank 0 admits until it says the step is done."""
    from rstar_hpc.rollout.agent import AgentLoop

    rank = comm.Get_rank()
    max_response, max_turns = stage_limits(cfg, stage)
    agent = AgentLoop(engine, tools, engine.tokenizer, cfg.rollout.agent, max_response_length=max_response,
                      max_turns=max_turns)
    comm.send({"capacity_tokens": engine.kv.capacity_tokens}, dest=0, tag=TAG_HELLO)
    tasks: set[asyncio.Task] = set()
    idle_s, last_beat = 0.0, 0.0
    t_start = last = time.monotonic()
    done = 0
    failure: list[str] = []

    async def one(item: dict) -> None:
        nonlocal done
        try:
            res = await agent.run(item["prompt_ids"], f"s{step}-{item['prompt_uid']}-{item['sample_index']}",
                                  item["prompt_text"])
        except Exception as e:   # the engine is gone (EngineDeadError, ...): rank 0 re-runs our work elsewhere
            log.exception("engine rank %d: trajectory failed", rank)
            failure.append(f"{type(e).__name__}: {e}")
            return
        msg = dataclasses.asdict(res)
        msg.update(prompt_uid=item["prompt_uid"], sample_index=item["sample_index"], engine_rank=rank,
                   policy_version=engine.policy_version)
        del msg["prompt_ids"], msg["prompt_text"]
        comm.send(msg, dest=0, tag=TAG_RESULT)
        done += 1

    while True:
        st = MPI.Status()
        while comm.Iprobe(source=0, tag=MPI.ANY_TAG, status=st):
            tag = st.Get_tag()
            msg = comm.recv(source=0, tag=tag)
            if tag == TAG_WORK:
                for item in msg:
                    t = asyncio.create_task(one(item))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
            elif tag in (TAG_DONE, TAG_STOP):
                stats = {"done": done, "idle_s": round(idle_s, 3), "wall_s": round(time.monotonic() - t_start, 3), "kv_capacity_tokens":
                         engine.kv.capacity_tokens, "preemptions": engine.kv.preemptions}
                if tag == TAG_DONE:
                    comm.send(stats, dest=0, tag=TAG_STOP)
                for t in list(tasks):
                    t.cancel()
                return stats
        if failure:
            comm.send("; ".join(failure[:3]), dest=0, tag=TAG_DEAD)
            for t in list(tasks):
                t.cancel()
            raise RuntimeError(f"engine rank {rank} failed: {failure[0]}")
        now = time.monotonic()
        if now - last_beat > cfg.rollout.scheduler.heartbeat_s:
            comm.send({"kv_usage": engine.kv.usage, "running": len(tasks)}, dest=0, tag=TAG_BEAT)
            last_beat = now
        await asyncio.sleep(0.005)
        now = time.monotonic()
        if not tasks:   # nothing admitted here: the engine idles
            idle_s += now - last
        last = now


def env_rank() -> int:
    for k in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        if k in os.environ:
            return int(os.environ[k])
    return 0
