"""An engine rank (1..N) of a rollout step: load the step's policy, run what rank 0 admits, report back.

Every admitted trajectory runs as an agent-loop coroutine (agent.py: generate, dispatch its tool calls to the
sandbox service, append their results, until it answers or hits a limit) on this rank's engine; its sampling seed
depends only on run seed, stage, step, prompt uid and sample index (step.request_seed). The rank reports its live
trajectories' context lengths in heartbeats (rank 0 books KV from them) and sends each finished one back. The
long-tail levers (levers.py): a trajectory rank 0 asks to MIGRATE leaves at its turn boundary, and PAUSE (a
partial-rollout step closed) stops them all; either way it goes back to rank 0 as a paused RESULT with its
agent-loop state, which another rank (or the next step) resumes. The messages are mpi.py's; rank 0's side is
scheduler.py.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time

from rstar_hpc.config.rollout import AgentConfig, SchedulerConfig
from rstar_hpc.rollout.agent import AgentLoop, Pause
from rstar_hpc.rollout.messages import TrajectoryResult, TurnDelta
from rstar_hpc.rollout.mpi import (TAG_ABORT, TAG_ACK, TAG_DEAD, TAG_DONE, TAG_EXIT, TAG_HELLO, TAG_KV, TAG_MIGRATE,
                                   TAG_MOVED, TAG_PAUSE, TAG_RESULT, TAG_SKIP, TAG_START, TAG_STATS, TAG_TURN,
                                   TAG_WORK, recv_from_rank0)
from rstar_hpc.config.stages import StageLimits
from rstar_hpc.rollout.step import WorkItem, request_seed

log = logging.getLogger("rstar_hpc.rollout")


async def run_engine_rank(comm, MPI, sc: SchedulerConfig, agent_cfg: AgentConfig, engine, tools, *,
                          run_seed: int) -> dict | None:
    """An engine rank for one rollout step: wait for rank 0's START (it names the stage, step, limits and
    policy), load the policy, then run what rank 0 admits until it says the step is done. Returns this rank's
    figures of the step; None when rank 0 ends the job instead (EXIT, read by the caller next)."""
    rank = comm.Get_rank()
    tag, start = await recv_from_rank0(comm, MPI, sc.policy_wait_s + sc.engine_timeout_s, "the next step",
                                       peek_exit=True)
    if tag == TAG_EXIT:
        return None
    if tag == TAG_ABORT:
        raise RuntimeError(f"rank 0 aborted the job: {start}")
    if tag == TAG_SKIP:   # already committed: nothing to run
        return {"done": 0, "skipped": True}
    if tag != TAG_START:
        raise RuntimeError(f"engine rank {rank}: expected the start of a step, got tag {tag}")
    stage, step, limits = start["stage"], start["step"], StageLimits(*start["limits"])
    syncs = rank in (start.get("policy_memory") or {}).get("first_ranks", {})
    loading = start["policy_version"] != engine.policy_version or syncs
    # stage and step name the START they answer: a HELLO that comes after its step ended (a slow load) is a leftover
    comm.send({"loading": loading, "stage": stage, "step": step}, dest=0, tag=TAG_ACK)
    doing = ["loading the policy" if loading else "warming up"]
    reports = asyncio.create_task(_report_start(comm, sc, doing))   # rank 0 hears a slow load move, or its death
    try:
        weights = await _load_weights(engine, start, rank)
        if hasattr(engine, "warm_up"):   # before HELLO: the step admits to a warm engine (VLLMEngine.warm_up)
            doing[0] = "warming up"
            await engine.warm_up()
    finally:
        reports.cancel()
    agent = AgentLoop(engine, tools, engine.tokenizer, agent_cfg, max_response_length=limits.max_response_length,
                      max_turns=limits.max_turns, sampling=limits.sampling())
    comm.send({"capacity_tokens": engine.kv.capacity_tokens, "policy_version": engine.policy_version,
               "weights": weights, "stage": stage, "step": step}, dest=0, tag=TAG_HELLO)
    return await _EngineStep(comm, MPI, sc, engine, agent, run_seed=run_seed, stage=stage, step=step).serve()


async def _report_start(comm, sc: SchedulerConfig, doing: list[str]) -> None:
    """While the engine starts (policy load, warm-up): a report every heartbeat_s saying what it does, so rank 0
    tells a long load from a lost engine (engine_timeout_s of silence) without waiting out policy_load_timeout_s."""
    while True:
        await asyncio.sleep(sc.heartbeat_s)
        comm.send({"starting": doing[0]}, dest=0, tag=TAG_KV)


def _test_fails_sync(start: dict, rank: int) -> bool:
    """RSTAR_HPC_TEST_SYNC_FAIL_AT_STEP=stage:step:rank (tests): this rank's sync of that step fails."""
    import os

    from rstar_hpc.exchange.weight_protocol import TEST_FAIL_ENV

    return os.environ.get(TEST_FAIL_ENV) == f"{start['stage']}:{start['step']}:{rank}"


async def _load_weights(engine, start: dict, rank: int) -> dict:
    """The step's policy: in memory from the trainer when START's sync session names this rank (rank 0 leaves out
    the engines that run that version already), else from the published files if it is new. A failed sync aborts
    the session (the other members fall back at once, not after its timeout) and falls back to the newest
    published files (START's policy_dir), said in the log and in the returned record (HELLO ->
    RUN/policy/sync.json -> `rstar-hpc run status`)."""
    session, version = start.get("policy_memory"), start["policy_version"]
    reason = start.get("memory_failed")
    if session is not None and rank not in session["first_ranks"]:
        session = None   # not a member: rank 0 knows this engine holds the version
        if version != engine.policy_version:
            reason = f"not in the sync session of v{version}, running v{engine.policy_version}"
            version = start.get("fallback_version")
    if session is not None:
        try:
            if _test_fails_sync(start, rank):
                raise RuntimeError(f"test hook: engine rank {rank} cannot join")
            st = await engine.sync_policy(session, session["first_ranks"][rank])
            log.info("engine rank %d: received policy v%d in memory in %.2fs (%.1f MB)", rank, version,
                     st["seconds"], st.get("bytes", 0) / 1e6)
            return {"via": "memory", "version": version, "seconds": round(st["seconds"], 3)}
        except Exception as e:   # noqa: BLE001  (cannot join the group: the files)
            reason = f"{type(e).__name__}: {e}"
            aborted = re.search(r"session aborted: [^']*", reason)   # another member's abort, through vLLM's rpc
            if aborted:
                reason = aborted.group(0)
            else:   # the others wait for this rank's join: let them go
                from rstar_hpc.rollout.weight_receiver import abort_session
                abort_session(session, f"engine rank {rank} could not join: {reason[:300]}")
            reason = reason[:300]
            version = start.get("fallback_version")
            if version is None or start.get("policy_dir") is None:
                raise RuntimeError(f"engine rank {rank}: in-memory sync failed ({reason}) and no published policy "
                                   f"to fall back to") from e
            log.warning("engine rank %d: in-memory sync failed (%s); falling back to the newest published files, "
                        "v%d", rank, reason, version)
            engine.policy_version = -1   # a failed sync may have loaded part of the buckets: reload in full
    if version is None or version == engine.policy_version:
        return {"via": "kept", "version": engine.policy_version}
    load_s = await engine.load_policy(start["policy_dir"], version)
    log.info("engine rank %d: loaded policy v%d in %.1fs", rank, engine.policy_version, load_s)
    out = {"via": "files", "version": version, "seconds": round(load_s, 3)}
    return {**out, "reason": reason} if reason else out


class _EngineStep:
    """One step's work on this rank: trajectories as tasks, the message loop with rank 0, idle-time accounting."""

    def __init__(self, comm, MPI, sc: SchedulerConfig, engine, agent: AgentLoop, *, run_seed: int, stage: str,
                 step: int):
        self.comm, self.MPI, self.sc, self.engine, self.agent = comm, MPI, sc, engine, agent
        self.run_seed, self.stage, self.step, self.rank = run_seed, stage, step, comm.Get_rank()
        self.tasks: set[asyncio.Task] = set()
        self.contexts: dict[tuple, int] = {}   # live trajectories' context lengths: rank 0 books KV from them
        self.pauses: dict[tuple, Pause] = {}
        self.pause_all = False                  # the step closed (partial rollouts): late work comes back paused
        self.paused = 0
        self.failure: list[str] = []
        self.done = 0
        self.idle_s, self.last_beat = 0.0, 0.0
        self.t_start = self.last = self.heard = time.monotonic()

    async def serve(self) -> dict:
        """Until rank 0 says DONE: take work, report, notice failures."""
        while True:
            stats = self.receive()
            if stats is not None:
                return stats
            self.check_health()
            now = time.monotonic()
            if now - self.last_beat > self.sc.heartbeat_s:
                self.comm.send({"kv_usage": self.engine.kv.usage, "running": len(self.tasks),
                                "contexts": dict(self.contexts), "movable": self.movable(),
                                # progress (roster.py): the core's token counter while requests are inside it
                                "tokens": getattr(self.engine.kv, "tokens", None),
                                "generating": getattr(self.engine, "generating", 0)}, dest=0, tag=TAG_KV)
                self.last_beat = now
            await asyncio.sleep(0.005)
            now = time.monotonic()
            if not self.tasks:   # nothing admitted here: the engine idles
                self.idle_s += now - self.last
            self.last = now

    def receive(self) -> dict | None:
        """Handle every message from rank 0 waiting now; the step's figures once it is over, else None."""
        st = self.MPI.Status()
        while self.comm.Iprobe(source=0, tag=self.MPI.ANY_TAG, status=st):
            tag = st.Get_tag()
            msg = self.comm.recv(source=0, tag=tag)
            self.heard = time.monotonic()
            if tag == TAG_WORK:
                for item in msg:
                    t = asyncio.create_task(self.one(item))
                    self.tasks.add(t)
                    t.add_done_callback(self.tasks.discard)
            elif tag == TAG_MIGRATE:   # let it go at its next turn boundary (once its tool result is appended)
                key = tuple(msg["key"])
                p = self.pauses.get(key)
                if p is not None:
                    p.at_boundary = True
                else:
                    self.comm.send({"key": key}, dest=0, tag=TAG_MOVED)
            elif tag == TAG_PAUSE:
                self.pause_all = True
                for p in self.pauses.values():
                    p.now.set()
            elif tag == TAG_ABORT:
                self.stop()
                raise RuntimeError(f"rank 0 aborted the job: {msg}")
            elif tag == TAG_DONE:
                kv = self.engine.kv
                stats = {"step": self.step, "done": self.done, "paused": self.paused, "idle_s": round(self.idle_s, 3),
                         "wall_s": round(time.monotonic() - self.t_start, 3),
                         "kv_capacity_tokens": kv.capacity_tokens, "preemptions": kv.preemptions}
                self.comm.send(stats, dest=0, tag=TAG_STATS)
                return self.stop(stats)
            # ALIVE (rank 0's heartbeat) only refreshes `heard`
        return None

    def movable(self) -> list[tuple]:
        """Live trajectories that can migrate (stateless tools), those waiting for a tool call first: they reach
        a turn boundary soonest."""
        return sorted(self.pauses, key=lambda k: not self.pauses[k].at_tool)

    def check_health(self) -> None:
        """Leave on a failed trajectory (the engine is gone; rank 0 re-runs our work) or a silent rank 0."""
        if self.failure:
            self.comm.send("; ".join(self.failure[:3]), dest=0, tag=TAG_DEAD)
            self.stop()
            raise RuntimeError(f"engine rank {self.rank} failed: {self.failure[0]}")
        silent = time.monotonic() - self.heard
        if silent > self.sc.engine_timeout_s:
            self.stop()
            raise RuntimeError(f"engine rank {self.rank}: rank 0 (the scheduler) silent for {silent:.0f}s; "
                               f"presumed dead, leaving step {self.step}")

    async def one(self, item: WorkItem) -> None:
        """One admitted trajectory, start to finish (or to a pause), sent back to rank 0 as a TrajectoryResult."""
        key, resume = item.key, item.resume
        self.contexts[key] = item.context_tokens
        seed = request_seed(self.run_seed, self.stage, self.step, *key)
        pause = None
        levers = self.sc.migrate_on_tool_call or self.sc.partial_rollouts
        if levers and self.agent.cfg.tool_state == "stateless":   # a tool session cannot follow it elsewhere
            self.pauses[key] = pause = Pause()
            if self.pause_all:
                pause.now.set()

        def progress(n: int) -> None:
            self.contexts[key] = n

        # partial rollouts: rank 0 keeps each trajectory's state at its latest turn boundary (what it added since
        # the last one), so this engine's death re-runs it from there (scheduler.lose)
        sent = [TurnDelta.sizes(resume) if resume else (0, 0, 0)]

        def boundary(res) -> None:
            self.comm.send(TurnDelta.since(res, key, self.step, sent[0]), dest=0, tag=TAG_TURN)
            sent[0] = TurnDelta.sizes(res)
        try:
            out = await self.agent.run(item.prompt_ids, f"s{self.step}-{item.prompt_uid}-{item.sample_index}",
                                       item.prompt_text, seed=seed, progress=progress, pause=pause, resume=resume,
                                       boundary=boundary if pause is not None and self.sc.partial_rollouts else None)
        except Exception as e:   # the engine is gone (EngineDeadError, ...): rank 0 re-runs our work elsewhere
            log.exception("engine rank %d: trajectory failed", self.rank)
            self.failure.append(f"{type(e).__name__}: {e}")
            return
        finally:
            self.contexts.pop(key, None)
            self.pauses.pop(key, None)
        # paused (migrating, or the step closed): `out` is the state to resume, on another rank or in the next step
        self.comm.send(TrajectoryResult(item.prompt_uid, item.sample_index, self.step, self.rank,
                                        self.engine.policy_version, out), dest=0, tag=TAG_RESULT)
        if out.paused:
            self.paused += 1
        else:
            self.done += 1

    def stop(self, stats: dict | None = None) -> dict:
        for t in list(self.tasks):
            t.cancel()
        return stats or {}
