"""The pool: N long-lived bwrap sandboxes on this node, a queue, sessions, stats.

Each sandbox (sandbox/bwrap.py) runs the worker package (sandbox/worker/) as its pid 1 and takes one call at a
time. Two kinds: math sandboxes (`num_workers`, numpy and sympy pre-imported; they hold every session) and light
ones (`light_workers`, stdlib only, several times cheaper to fork) for stateless calls that import nothing a
light interpreter lacks (sandbox.route); either kind alone can keep the cores busy. Stateless calls go to their
kind's shared FIFO; a session's calls go to the sandbox that holds the session, in the order they were submitted
(one at a time, since a sandbox runs one call at a time). A sandbox is replaced after `recycle_after` calls, when
it dies, when it stops answering (`hang_grace_s` past a call's deadline), or when its sweep after a call
fails; the other sandboxes keep serving meanwhile.

Sessions (sandbox/sessions.py: their states, replay and history) live in math sandboxes. A sandbox holds at most
`max_sessions_per_worker` of them (each is a process, under the sandbox's process limit): a new session beyond
that evicts the least recently used idle one of any math sandbox, or, while every held session has a cell queued
or running, waits (its cells parked, in order) until one of those ends. A session ends when its caller releases it
(`release(sid)`, the service's op "release": its process and history go, after any cells already queued) or, never
released (a killed caller), once idle for 4 x session_idle_s.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import time

from sandbox.bwrap import Sandbox, SandboxDied
from sandbox.limits import Limits
from sandbox.results import make_result
from sandbox.route import LIGHT, MATH, route
from sandbox.sessions import Session
from sandbox.stats import LATENCY_BUCKETS_MS, Stats

log = logging.getLogger("sandbox")


@dataclasses.dataclass
class _Job:
    call: dict
    fut: asyncio.Future
    submitted: float
    kind: str = "exec"            # exec | drop


class _Slot:
    def __init__(self, index: int, sandbox: Sandbox):
        self.index = index
        self.sandbox = sandbox
        self.kind = sandbox.kind
        self.pinned: collections.deque[_Job] = collections.deque()
        self.wake = asyncio.Event()
        self.busy = False
        self.sessions: set[str] = set()
        self.task: asyncio.Task | None = None
        self.restarts = 0
        self.idle_since = 0.0


class Pool:
    """Async front of the sandboxes. `await pool.start()`, then `await pool.run(call)` from any task."""

    def __init__(self, limits: Limits | None = None, *, seccomp: bool = True):
        self.limits = limits or Limits()
        self.use_seccomp = seccomp
        self.slots: list[_Slot] = []       # math sandboxes first (sessions live there), then light ones
        self.queue: collections.deque[_Job] = collections.deque()         # stateless calls for math sandboxes
        self.light_queue: collections.deque[_Job] = collections.deque()   # ... and for light ones
        self.sessions: dict[str, Session] = {}
        self.unplaced: collections.deque[Session] = collections.deque()   # waiting for room, in arrival order
        self.stats = Stats()
        self.started = time.time()
        self._closing = False
        self._housekeeper: asyncio.Task | None = None
        self.light_modules: frozenset[str] = frozenset()

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        bpf = None
        if self.use_seccomp:
            from sandbox.seccomp import build_filter
            bpf = build_filter()
        n, m = self.limits.workers(), self.limits.light()
        cpus = sorted(os.sched_getaffinity(0)) if self.limits.pin_cpus else [None]
        self.slots = [_Slot(i, Sandbox(i, self.limits, bpf, MATH if i < n else LIGHT,
                                       cpus[(i if i < n else i - n) % len(cpus)])) for i in range(n + m)]
        self.math_slots, self.light_slots = self.slots[:n], self.slots[n:]
        await asyncio.gather(*(s.sandbox.start() for s in self.slots))
        if self.light_slots:   # what a light cell can import for free (the same in every light sandbox)
            self.light_modules = frozenset(self.light_slots[0].sandbox.info.get("modules") or ())
        for s in self.slots:
            s.task = asyncio.create_task(self._slot_loop(s))
        self._housekeeper = asyncio.create_task(self._housekeeping())
        log.info("sandbox pool: %d math sandboxes (preloaded %s) and %d light ones ready (uid %s)", n,
                 self.slots[0].sandbox.info.get("preloaded"), m, self.slots[0].sandbox.info.get("uid"))

    async def close(self) -> None:
        self._closing = True
        for s in self.slots:
            if s.task:
                s.task.cancel()
        if self._housekeeper:
            self._housekeeper.cancel()
        await asyncio.gather(*(s.sandbox.kill() for s in self.slots), return_exceptions=True)
        parked = [j for sess in self.unplaced for j in sess.parked]
        for job in list(self.queue) + list(self.light_queue) + [j for s in self.slots for j in s.pinned] + parked:
            if not job.fut.done():
                job.fut.set_result(make_result(job.call.get("id"), "unavailable", "service shutting down"))

    async def __aenter__(self) -> Pool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ submission
    def submit(self, call: dict) -> asyncio.Future:
        """Enqueue a validated call (see protocol.validate_call) now; the future resolves to its result.
        Calls of one session run in the order submit() was called."""
        fut = asyncio.get_running_loop().create_future()
        if self._closing:
            fut.set_result(make_result(call.get("id"), "unavailable", "service shutting down"))
            return fut
        job = _Job(call, fut, time.monotonic())
        sid = call.get("session")
        if sid is None:
            # sessions stay in math sandboxes: a later cell may import numpy, and state cannot move
            light = self.light_slots and route(call["code"], self.limits.preload, self.light_modules) == LIGHT
            queue, slots = (self.light_queue, self.light_slots) if light else (self.queue, self.math_slots)
            queue.append(job)
            # longest-idle first: a sandbox that just answered is still sweeping and pre-forking its next cell
            for s in sorted((s for s in slots if not s.busy), key=lambda s: s.idle_since):
                s.wake.set()
        else:
            sess = self.sessions.get(sid)
            if sess is None:
                sess = self.sessions[sid] = Session(sid)
            if sess.slot is None and not sess.parked and not self._place(sess):
                self.unplaced.append(sess)
            sess.pending += 1
            sess.last_used = time.time()
            if sess.slot is None:
                sess.parked.append(job)
            else:
                slot = self.slots[sess.slot]
                slot.pinned.append(job)
                slot.wake.set()
        return fut

    async def run(self, call: dict) -> dict:
        return await self.submit(call)

    def release(self, sid: str) -> bool:
        """The caller is done with session `sid` (its trajectory ended): free its process and forget its history
        now, or after its queued cells if some are still pending. False: this service does not know it."""
        sess = self.sessions.get(sid)
        if sess is None:
            return False
        sess.released = True
        if sess.pending == 0:
            self._forget(sess)
            self._admit()
        return True

    def _forget(self, sess: Session) -> None:
        if sess.slot is not None:
            self._evict(sess, "released")
        self.sessions.pop(sess.sid, None)
        self.stats.released += 1

    def _place(self, sess: Session) -> bool:
        """Give `sess` a math sandbox with room (module docstring); False: none has room yet."""
        room = [s for s in self.math_slots if len(s.sessions) < self.limits.max_sessions_per_worker]
        if room:
            slot = min(room, key=lambda s: (len(s.sessions), len(s.pinned), s.busy))
        else:
            idle = [self.sessions[x] for s in self.math_slots for x in s.sessions if self.sessions[x].pending == 0]
            if not idle:
                return False
            victim = min(idle, key=lambda x: x.last_used)
            slot = self.slots[victim.slot]
            self._evict(victim, "capacity")
        sess.slot = slot.index
        slot.sessions.add(sess.sid)
        return True

    def _admit(self) -> None:
        """Place the waiting sessions while there is room, their parked cells in order."""
        while self.unplaced and self._place(self.unplaced[0]):
            sess = self.unplaced.popleft()
            slot = self.slots[sess.slot]
            slot.pinned.extend(sess.parked)
            sess.parked.clear()
            slot.wake.set()

    def _evict(self, sess: Session, why: str) -> None:
        slot = self.slots[sess.slot]
        slot.sessions.discard(sess.sid)
        if sess.live:
            fut = asyncio.get_running_loop().create_future()
            slot.pinned.append(_Job({"session": sess.sid}, fut, time.monotonic(), kind="drop"))
            slot.wake.set()
        sess.slot, sess.live, sess.pss = None, False, 0
        sess.why_gone = f"evicted ({why})"
        if why != "released":   # evictions are pressure (idle, memory, capacity); a release is the normal end
            self.stats.evictions[why] += 1

    def _lose_slot_sessions(self, slot: _Slot, why: str) -> None:
        for sid in list(slot.sessions):
            sess = self.sessions[sid]
            if sess.live:
                sess.live, sess.pss = False, 0
                sess.why_gone = why

    # ------------------------------------------------------------ the slot loop
    def _take(self, slot: _Slot) -> _Job | None:
        if slot.pinned:
            return slot.pinned.popleft()
        queue = self.light_queue if slot.kind == LIGHT else self.queue
        if queue:
            return queue.popleft()
        return None

    async def _slot_loop(self, slot: _Slot) -> None:
        while True:
            job = self._take(slot)
            if job is None:
                slot.wake.clear()
                await slot.wake.wait()
                continue
            slot.busy = True
            try:
                if not slot.sandbox.alive:
                    await self._restart(slot, "sandbox process was gone")
                if job.kind == "drop":
                    await self._drop(slot, job)
                else:
                    await self._execute(slot, job)
            except asyncio.CancelledError:
                raise
            except Exception as e:   # never lose a job: answer it, then keep serving
                log.exception("sandbox %d: unexpected failure", slot.index)
                if not job.fut.done():
                    job.fut.set_result(make_result(job.call.get("id"), "internal_error", f"service error: {e!r}",
                                                   maybe_executed=True))
            finally:
                slot.busy = False
                slot.idle_since = time.monotonic()
            if slot.sandbox.calls >= self.limits.recycle_after:
                await self._restart(slot, f"recycled after {slot.sandbox.calls} calls")

    async def _restart(self, slot: _Slot, why: str) -> None:
        self._lose_slot_sessions(slot, f"sandbox {why}")
        self.stats.restarts[why.split(" ")[0]] += 1
        slot.restarts += 1
        await slot.sandbox.kill()
        delay = 0.5
        while not self._closing:
            try:
                await slot.sandbox.start()
                return
            except Exception as e:
                log.error("sandbox %d: restart failed (%s); retrying in %.1f s", slot.index, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30)

    async def _drop(self, slot: _Slot, job: _Job) -> None:
        # even if the session was placed here again meanwhile: its exec job comes after this one and,
        # the session being marked not live, starts a new holder and replays
        try:
            reply = await slot.sandbox.request({"op": "drop", "session": job.call["session"]}, 10.0)
            self._note_lost(slot, reply)
        except SandboxDied as e:
            await self._restart(slot, f"died ({e})")
        job.fut.set_result(None)

    def _note_lost(self, slot: _Slot, reply: dict) -> None:
        for sid, why in (reply.get("lost_sessions") or {}).items():
            sess = self.sessions.get(sid)
            if sess is not None and sess.slot == slot.index and sess.live:
                sess.live, sess.pss, sess.why_gone = False, 0, why

    async def _cell(self, slot: _Slot, code: str, stdin: str, timeout: float, session: str | None) -> dict:
        slot.sandbox.calls += 1
        msg = {"op": "exec", "code": code, "stdin": stdin, "timeout_s": timeout, "session": session}
        reply = await self._exec(slot, msg, timeout)
        if "refused" in reply:
            # the sandbox found itself unclean after its previous call and ran nothing: replace, resend once
            await self._restart(slot, f"anomaly ({reply['refused']})")
            reply = await self._exec(slot, msg, timeout)
            if "refused" in reply:
                return {"status": "internal_error", "reason": "fresh sandbox refused the call: " + reply["refused"]}
        return reply

    async def _exec(self, slot: _Slot, msg: dict, timeout: float) -> dict:
        """The sandbox's reply, or an internal_error result once a sandbox that died or hung mid-call is replaced."""
        try:
            reply = await slot.sandbox.request(msg, timeout + self.limits.hang_grace_s)
        except SandboxDied as e:
            await self._restart(slot, f"died or hung ({e})")
            return {"status": "internal_error", "maybe_executed": True,
                    "reason": f"the sandbox failed during the call and was replaced: {e}"}
        self._note_lost(slot, reply)
        return reply

    async def _execute(self, slot: _Slot, job: _Job) -> None:
        call = job.call
        started = time.monotonic()
        sid = call.get("session")
        sess = self.sessions.get(sid) if sid else None
        session_info = None
        if sess is None:
            reply = await self._cell(slot, call["code"], call["stdin"], call["timeout_s"], None)
        else:
            session_info = sess.prepare(call, self.limits.max_history_bytes)
            if session_info["state"] == "replayed":
                t0 = time.monotonic()
                # output discarded, errors ignored (the module docstring); a replayed cell that takes the
                # session's process down is ignored too: the cells after it run in a fresh one
                for code, stdin, timeout in sess.history:
                    await self._cell(slot, code, stdin, timeout, sid)
                session_info["replay_s"] = round(time.monotonic() - t0, 6)
            reply = await self._cell(slot, call["code"], call["stdin"], call["timeout_s"], sid)
            sess.finish(call, reply, session_info, self.limits.max_history_bytes)
            if sess.released and sess.pending == 0:
                self._forget(sess)
            self._admit()   # a session between cells can make room
        reply.pop("lost_sessions", None)
        for key in ("session_alive", "session_created", "session_rolled_back", "session_note", "session_pss"):
            reply.pop(key, None)
        status = reply.pop("status")
        reason = reply.pop("reason", None)
        result = make_result(call["id"], status, reason, **reply)
        result["queue_s"] = round(started - job.submitted, 6)
        result["session"] = session_info
        result["worker"] = slot.index
        result["sandbox"] = slot.kind
        self.stats.record(result, time.monotonic() - job.submitted)
        job.fut.set_result(result)

    # ------------------------------------------------------------ eviction and health
    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.evict_now()
            for slot in self.slots:
                queue = self.light_queue if slot.kind == LIGHT else self.queue
                if not slot.busy and not slot.sandbox.alive and not slot.pinned and not queue:
                    slot.wake.set()   # the loop restarts it before its next job; nudge it so it is ready

    def evict_now(self) -> None:
        now = time.time()
        live = [s for s in self.sessions.values() if s.slot is not None and s.pending == 0]
        for sess in live:
            if now - sess.last_used > self.limits.session_idle_s:
                self._evict(sess, "idle")
        budget = self.limits.session_memory_mb << 20
        live = sorted((s for s in self.sessions.values() if s.slot is not None and s.pending == 0),
                      key=lambda s: s.last_used)
        total = sum(s.pss for s in self.sessions.values() if s.live)
        for sess in live:
            if total <= budget:
                break
            total -= sess.pss
            self._evict(sess, "memory")
        self._admit()
        # forget sessions idle for long (their history too): a later cell reports state "lost"
        for sid, sess in list(self.sessions.items()):
            if sess.slot is None and sess.pending == 0 and now - sess.last_used > 4 * self.limits.session_idle_s:
                del self.sessions[sid]

    def snapshot(self) -> dict:
        st = self.stats
        p50, p99 = st.quantile(0.5), st.quantile(0.99)
        return {
            "workers": len(self.math_slots), "workers_alive": sum(s.sandbox.alive for s in self.math_slots),
            "light_workers": len(self.light_slots),
            "light_workers_alive": sum(s.sandbox.alive for s in self.light_slots),
            "queue_depth": len(self.queue) + len(self.light_queue) + sum(len(s.pinned) for s in self.slots),
            "in_flight": sum(s.busy for s in self.slots), "calls": st.calls, "by_status": dict(st.by_status),
            "latency_ms_buckets": list(LATENCY_BUCKETS_MS) + ["inf"], "latency_hist": list(st.hist),
            "p50_ms": None if p50 is None else round(p50 * 1000, 3),
            "p99_ms": None if p99 is None else round(p99 * 1000, 3),
            "restarts": dict(st.restarts), "evictions": dict(st.evictions),
            "sessions_live": sum(s.live for s in self.sessions.values()), "sessions_known": len(self.sessions),
            "session_states": dict(st.sessions), "sessions_released": st.released, "session_memory_mb": round(
                sum(s.pss for s in self.sessions.values()) / 2**20, 1),
            "uptime_s": round(time.time() - self.started, 1),
        }
