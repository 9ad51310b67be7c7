"""One rollout step over MPI: rank 0 schedules and writes, ranks 1..N each own one vLLM engine.

    mpirun -n 3 python jobs/rollout.py --config tiny-cpu --step 0        # or srun --mpi=pmix under Slurm

A step: rank 0 waits until the trainer has published the policy the step needs (`wait_for_policy`: trained
through step N - max_policy_lag) and names it in START; each engine rank acks at once, loads it in place if
it is new, and says HELLO with its KV capacity. Rank 0 holds the step's trajectories in a FIFO and admits
each with the shared policy (policy.py: `kv_aware` or `static`) to an engine rank, which keeps it for all its
turns. Engine ranks run every admitted trajectory as an agent-loop coroutine (agent.py; its sampling seed
depends only on run seed, stage, step, prompt uid and sample index) against their engine and the sandbox
service, report their live trajectories' context lengths in heartbeats (KV booking), and send each finished
one back; rank 0 releases its booking, admits more at once, scores it (reward and RoC quality signals, off
the generation path: generation goes on meanwhile), and at the end writes all of them in ONE committed shard
set (producer "rollout"). So a trajectory is written once, or, if rank 0 dies, not at all (a rerun of the
step starts clean: the commit record is the only publication).

Engine death: an engine rank that reports its engine dead, or is silent for `engine_timeout_s`, is dropped
for the rest of the job; its unfinished trajectories go back to the front of the queue and run on the others
from scratch. A late result for a trajectory already re-run is ignored (results carry their step and are keyed
by (prompt_uid, sample_index)). Under mpirun this needs `--mca orte_enable_recovery 1` (Open MPI 4) so one
rank's death does not end the job. Rank 0 death: rank 0 heartbeats too, and sends ABORT when it fails; an
engine rank that hears nothing from it for `engine_timeout_s` leaves instead of waiting forever.

MPI is initialised AFTER the engine is built and finalised after it is shut down (kv-balancing.md §4.6).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass

from rstar_hpc.rollout.policy import KVAwarePolicy, StaticPolicy, make_policy  # noqa: F401 (shared API)

log = logging.getLogger("rstar_hpc.rollout")

(TAG_HELLO, TAG_WORK, TAG_RESULT, TAG_BEAT, TAG_DONE, TAG_STOP, TAG_DEAD, TAG_START, TAG_ABORT, TAG_EXIT,
 TAG_BYE) = range(1, 12)
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
def step_items(cfg, stage_name: str, step: int, tokenizer, rows: list[dict]) -> tuple[list[WorkItem], list[str]]:
    """The step's prompts (out of the stage's `rows`, datasets.load_prompts) x num_samples_per_prompt, and the
    uids of prompts dropped as over-long (the reference filters them: they cannot be trained on)."""
    from rstar_hpc.rollout.agent import PromptTooLong, encode_prompt

    n = cfg.stage(stage_name).prompts_per_step
    if n > len(rows):
        raise ValueError(f"stage {stage_name!r}: prompts_per_step={n} but the data has {len(rows)} prompts; a step "
                         f"cannot hold a prompt twice (its uid names one GRPO group): lower prompts_per_step")
    prompts = [rows[(step * n + i) % len(rows)] for i in range(n)]   # epochs wrap around the file
    items, dropped = [], []
    for p in prompts:
        uid = p["uid"]
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


# --------------------------------------------------------------------------------------------------- policy
def required_trainer_step(cfg, step: int) -> int | None:
    """The trainer step a policy must have reached to generate `step`: on-policy, step N runs the weights
    trained on step N-1 (trainer_step N), `max_policy_lag` steps older allowed. None: anything goes."""
    need = step - cfg.rollout.scheduler.max_policy_lag
    return need if need > 0 else None


def wait_for_policy(cfg, paths, stage: str, step: int, *, poll_s: float = 1.0) -> tuple[int, str] | None:
    """(version, directory) of the newest published policy good enough for `step`, waiting for the trainer
    to publish it (`policy_wait_s`); None when the step may run the base model and nothing is published."""
    dirs = paths.policies()
    need = required_trainer_step(cfg, step)
    deadline = time.monotonic() + cfg.rollout.scheduler.policy_wait_s
    waited = False
    while True:
        for v in sorted(dirs.complete_steps(), reverse=True):
            if need is None:
                return v, str(dirs.path(v))
            meta = dirs.marker(v)
            if meta.get("stage") == stage and int(meta.get("trainer_step", -1)) >= need:
                return v, str(dirs.path(v))
        if need is None:
            return None
        if not waited:
            log.info("step %d of stage %s waits for a policy with trainer_step >= %d (max_policy_lag=%d)",
                     step, stage, need, cfg.rollout.scheduler.max_policy_lag)
            waited = True
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rollout step {step} of stage {stage!r} needs a policy the trainer published after training "
                f"step {need} of that stage (COMMITTED.json trainer_step >= {need} under {dirs.root}); none "
                f"appeared in {cfg.rollout.scheduler.policy_wait_s:.0f}s. Is the trainer running? "
                f"(rollout.scheduler.max_policy_lag allows older policies; policy_wait_s waits longer)")
        time.sleep(poll_s)


# --------------------------------------------------------------------------------------------------- rank 0
def run_scheduler(comm, MPI, cfg, paths, stage: str, step: int, items: list[WorkItem], *, dropped=(),
                  progress=None, dead_ranks: set[int] | None = None) -> dict:
    """Rank 0: admit, collect, score, write. Returns the step's summary (also appended to metrics/rollout).
    `dead_ranks` carries the engine ranks lost in earlier steps of this job (updated in place)."""
    from rstar_hpc.exchange.writer import ShardWriter

    sc = cfg.rollout.scheduler
    max_response, _ = stage_limits(cfg, stage)
    dead_ranks = set() if dead_ranks is None else dead_ranks
    if comm.Get_size() < 2:
        raise RuntimeError("the rollout step needs at least 2 MPI ranks: rank 0 schedules, ranks 1.. run engines")
    engines = [e for e in range(1, comm.Get_size()) if e not in dead_ranks]
    if not engines:
        raise RuntimeError(f"all engine ranks died in earlier steps ({sorted(dead_ranks)}); step {step} cannot run")
    if ShardWriter.is_committed(paths, stage, step, PRODUCER):
        log.info("step %d of stage %s already committed: nothing to do", step, stage)
        for e in engines:
            comm.send(None, dest=e, tag=TAG_STOP)
        return {"step": step, "skipped": True}
    policy_ref = wait_for_policy(cfg, paths, stage, step)
    t_start = time.monotonic()
    start = {"policy_version": None, "policy_dir": None}
    if policy_ref is not None:
        start = {"policy_version": policy_ref[0], "policy_dir": policy_ref[1]}
    sends: list = [comm.isend(start, dest=e, tag=TAG_START) for e in engines]
    hello: dict[int, dict] = {}
    # an engine acks the start at once, then loads the step's policy, then says hello: one that does not
    # ack is dead after engine_timeout_s, one that loads gets policy_load_timeout_s more
    acked: set[int] = set()
    t0 = time.monotonic()
    last_beat = 0.0
    while len(hello) < len(engines):
        now = time.monotonic()
        if all(now - t0 > sc.engine_timeout_s + (sc.policy_load_timeout_s if e in acked else 0)
               for e in engines if e not in hello):
            break
        st = MPI.Status()
        if comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=st):
            src, tag = st.Get_source(), st.Get_tag()
            msg = comm.recv(source=src, tag=tag)
            if tag == TAG_HELLO:
                hello[src] = msg
            elif tag == TAG_BEAT:
                acked.add(src)
            # anything else is a leftover of the previous step (a late result or beat): dropped
        else:
            time.sleep(0.005)
        if now - last_beat > sc.heartbeat_s:   # engines that are ready wait for the slow loaders
            sends += [comm.isend(None, dest=e, tag=TAG_BEAT) for e in hello]
            last_beat = now
    if not hello:
        raise RuntimeError(f"no engine rank started step {step} (waited {time.monotonic() - t0:.0f}s)")
    missing = [e for e in engines if e not in hello]
    if missing:
        log.error("engine ranks %s did not start step %d; running without them", missing, step)
    engines = sorted(hello)
    policy = make_policy(sc.policy, {e: hello[e]["capacity_tokens"] for e in engines}, max_response=max_response,
                         growth_reserve=sc.growth_reserve, budget_coef=sc.budget_coef,
                         max_per_engine=sc.max_trajectories_per_engine)
    by_key = {it.key: it for it in items}
    if len(by_key) != len(items):
        raise ValueError("duplicate (prompt_uid, sample_index) in the step's prompts; uids must be unique")
    for it in items:
        policy.check_fits_somewhere(len(it.prompt_ids))
    pending: deque = deque(items)
    queued_at = {it.key: 0.0 for it in items}
    results: dict = {}
    alive = {e: time.monotonic() for e in engines}
    dead: list[int] = list(missing)
    engine_stats: dict = {}
    reward_s = 0.0
    reruns = 0
    infra_failures = 0

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
            e = policy.place(it.key, len(it.prompt_ids))
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
                if msg.pop("step") != step or key in results or key not in by_key:
                    continue
                if policy.placed.get(key) is not None:
                    policy.release(key)
                t0 = time.perf_counter()
                infra_failures += msg.pop("infra_failures", 0)
                results[key] = _to_trajectory(cfg, stage, step, by_key[key], msg, queued_at[key])
                reward_s += time.perf_counter() - t0
                if progress is not None:
                    progress(1)
            elif tag == TAG_BEAT:
                policy.observe(src, msg.get("contexts", {}))
            elif tag == TAG_DEAD:
                lose(src, msg)
        now = time.monotonic()
        if now - last_beat > sc.heartbeat_s:   # engines leave when rank 0 goes silent (died)
            sends += [comm.isend(None, dest=e, tag=TAG_BEAT) for e in alive]
            last_beat = now
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
    for e in alive:
        if e not in engine_stats:   # its results are all in, but the rank is gone: the next step goes on without it
            log.error("engine rank %d did not report at the end of step %d; presumed dead", e, step)
            dead.append(e)
    dead_ranks.update(dead)
    trajs = [results[it.key] for it in items]
    last_admit = max(queued_at.values(), default=0.0)
    with ShardWriter(paths, stage, step, PRODUCER) as w:
        w.write(trajs)
    summary = {
        "step": step, "stage": stage, "policy": sc.policy, "trajectories": len(trajs),
        "dropped_prompts": list(dropped), "engines": engines, "dead_engines": dead, "reruns": reruns,
        "wall_s": round(time.monotonic() - t_start, 3), "generation_wall_s": round(gen_s, 3),
        # the step's long tail: generation went on this long after its last trajectory was admitted
        "last_admit_s": round(last_admit, 3), "tail_s": round(gen_s - last_admit, 3),
        "reward_s": round(reward_s, 4), "policy_version": start["policy_version"],
        "tool_infra_failures": infra_failures,
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
    log.info("step %d of stage %s: %d trajectories in %.1f s (generation %.1f s, all admitted by %.1f s, tail "
             "%.1f s; tool wait %.1f s summed over trajectories; reward %.2f s on rank 0; mean reward %.3f)",
             step, stage, len(trajs), summary["wall_s"], gen_s, summary["last_admit_s"], summary["tail_s"],
             summary["tool_wait_s"], reward_s, summary["mean_reward"])
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
async def recv_from_rank0(comm, MPI, timeout_s: float, what: str) -> tuple[int, object]:
    """The next message from rank 0 (tag, payload); a silent rank 0 is a dead one: give up, do not hang."""
    deadline = time.monotonic() + timeout_s
    st = MPI.Status()
    while True:
        while not comm.Iprobe(source=0, tag=MPI.ANY_TAG, status=st):
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank 0 (the scheduler) sent nothing for {timeout_s:.0f}s while this rank "
                                   f"waited for {what}; it is presumed dead")
            await asyncio.sleep(0.01)
        tag = st.Get_tag()
        msg = comm.recv(source=0, tag=tag)
        if tag != TAG_BEAT:   # a late heartbeat of the previous step
            return tag, msg


async def run_engine_rank(comm, MPI, cfg, engine, tools, stage: str, step: int) -> dict:
    """An engine rank for one step: load the step's policy, then run what rank 0 admits until it says the
    step is done."""
    from rstar_hpc.rollout.agent import AgentLoop

    sc = cfg.rollout.scheduler
    rank = comm.Get_rank()
    tag, start = await recv_from_rank0(comm, MPI, sc.policy_wait_s + sc.engine_timeout_s, f"step {step}")
    if tag == TAG_ABORT:
        raise RuntimeError(f"rank 0 aborted the job: {start}")
    if tag == TAG_STOP:   # already committed: nothing to run
        return {"done": 0, "skipped": True}
    if tag != TAG_START:
        raise RuntimeError(f"engine rank {rank}: expected the start of step {step}, got tag {tag}")
    comm.send({"loading": start["policy_version"] != engine.policy_version}, dest=0, tag=TAG_BEAT)
    if start["policy_version"] is not None and start["policy_version"] != engine.policy_version:
        load_s = await engine.load_policy(start["policy_dir"], start["policy_version"])
        log.info("engine rank %d: loaded policy v%d in %.1fs", rank, engine.policy_version, load_s)
    max_response, max_turns = stage_limits(cfg, stage)
    agent = AgentLoop(engine, tools, engine.tokenizer, cfg.rollout.agent, max_response_length=max_response,
                      max_turns=max_turns)
    comm.send({"capacity_tokens": engine.kv.capacity_tokens, "policy_version": engine.policy_version},
              dest=0, tag=TAG_HELLO)
    tasks: set[asyncio.Task] = set()
    contexts: dict[tuple, int] = {}   # live trajectories' context lengths: the scheduler books KV from them
    idle_s, last_beat = 0.0, 0.0
    t_start = last = heard = time.monotonic()
    done = 0
    failure: list[str] = []

    async def one(item: dict) -> None:
        nonlocal done
        key = (item["prompt_uid"], item["sample_index"])
        contexts[key] = len(item["prompt_ids"])
        seed = request_seed(cfg.run.seed, stage, step, *key)

        def progress(n: int) -> None:
            contexts[key] = n
        try:
            res = await agent.run(item["prompt_ids"], f"s{step}-{item['prompt_uid']}-{item['sample_index']}",
                                  item["prompt_text"], seed=seed, progress=progress)
        except Exception as e:   # the engine is gone (EngineDeadError, ...): rank 0 re-runs our work elsewhere
            log.exception("engine rank %d: trajectory failed", rank)
            failure.append(f"{type(e).__name__}: {e}")
            return
        finally:
            contexts.pop(key, None)
        msg = dataclasses.asdict(res)
        msg.update(prompt_uid=item["prompt_uid"], sample_index=item["sample_index"], engine_rank=rank,
                   policy_version=engine.policy_version, step=step)
        del msg["prompt_ids"], msg["prompt_text"]
        comm.send(msg, dest=0, tag=TAG_RESULT)
        done += 1

    def stop(stats: dict | None = None) -> dict:
        for t in list(tasks):
            t.cancel()
        return stats or {}

    while True:
        st = MPI.Status()
        while comm.Iprobe(source=0, tag=MPI.ANY_TAG, status=st):
            tag = st.Get_tag()
            msg = comm.recv(source=0, tag=tag)
            heard = time.monotonic()
            if tag == TAG_WORK:
                for item in msg:
                    t = asyncio.create_task(one(item))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
            elif tag == TAG_ABORT:
                stop()
                raise RuntimeError(f"rank 0 aborted the job: {msg}")
            elif tag in (TAG_DONE, TAG_STOP):
                stats = {"done": done, "idle_s": round(idle_s, 3), "wall_s": round(time.monotonic() - t_start, 3),
                         "kv_capacity_tokens": engine.kv.capacity_tokens, "preemptions": engine.kv.preemptions}
                if tag == TAG_DONE:
                    comm.send(stats, dest=0, tag=TAG_STOP)
                return stop(stats)
        if failure:
            comm.send("; ".join(failure[:3]), dest=0, tag=TAG_DEAD)
            stop()
            raise RuntimeError(f"engine rank {rank} failed: {failure[0]}")
        now = time.monotonic()
        if now - heard > sc.engine_timeout_s:
            stop()
            raise RuntimeError(f"engine rank {rank}: rank 0 (the scheduler) silent for {now - heard:.0f}s; "
                               f"presumed dead, leaving step {step}")
        if now - last_beat > sc.heartbeat_s:
            comm.send({"kv_usage": engine.kv.usage, "running": len(tasks), "contexts": dict(contexts)},
                      dest=0, tag=TAG_BEAT)
            last_beat = now
        await asyncio.sleep(0.005)
        now = time.monotonic()
        if not tasks:   # nothing admitted here: the engine idles
            idle_s += now - last
        last = now


def request_seed(run_seed: int, stage: str, step: int, prompt_uid: str, sample_index: int) -> int:
    """A sampling seed per trajectory, the same wherever and whenever it runs (a re-run after an engine's
    death samples what the lost run would have): reproducible for a given run seed."""
    h = hashlib.blake2b(f"{run_seed}/{stage}/{step}/{prompt_uid}/{sample_index}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1


def env_rank() -> int:
    for k in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        if k in os.environ:
            return int(os.environ[k])
    return 0
