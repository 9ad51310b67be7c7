"""Async client for sandbox services on many nodes (what rollout ranks use).

    async with SandboxClient(run_dir=RUN_DIR) as sb:          # or addresses=["node3:41234", ...]
        r = await sb.run("print(2 + 2)")                     # -> result dict (sandbox.results)
        r = await sb.run("x = 1", session="traj-17")         # later cells of traj-17 see x

Batching: one sender per service takes the first queued call, then whatever else is already queued, up to
64 per frame, and sends at once (no linger); results come back one frame per call as they finish.
Placement: a stateless call goes to the service with the fewest outstanding calls per worker; a session
stays on the service that first ran it.
Retries: only infrastructure failures are retried (connection refused/reset, a service shutting down, a
sandbox that died mid-call), on another service, at most `max_attempts` times in all. User-code failures
(error, timeout, memory, ...) are results and never retried. A call that may have run before its retry
comes back with `attempts` > 1 and `maybe_executed_before: true`; a call that was never sent is retried
silently (it cannot have run). A service that is alive but frozen (SIGSTOPped, wedged, unreachable behind a
live TCP connection) counts as failed, like a dead one, once a call sent to it outlives its deadline: its own
time limit (`timeout_s`, or the service's announced default) plus `reply_margin_s`, counted from the later of
its send and the service's last reply (a busy service answering its queue is not frozen).
A service that dies or restarts (the sbatch supervisor restarts a dead sandbox step): a call that was never sent
cannot have run, so once its attempts are spent with no service reachable it waits, up to `service_wait_s`,
re-reading the run directory's announcements every second, for a service to come back (the restarted one, or
another pool), and runs there; only then is it `unavailable`. A call in flight on the dead service gets its
`max_attempts` on the services there are and is otherwise given up at once as `internal_error` with
`maybe_executed` (an infrastructure status, never a verdict on the code): it may have run, and its trajectory is
tainted either way. No call is reported ok unless a service ran it and answered.
A session whose service died continues elsewhere with fresh state, flagged by that service as state "lost"
(the client sends each cell's `session_seq`). `await sb.release("traj-17")` ends a session: its service frees
the process and history (after any cell already sent), and cells still queued here are dropped unsent.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time

from rstar_hpc.exchange.rendezvous import read_announcements
from sandbox.protocol import MAX_BATCH, encode, read_frame
from sandbox.results import make_result

log = logging.getLogger("sandbox.client")


class _Pending:
    __slots__ = ("attempts", "call", "fut", "sent_at", "sent_before", "size", "waiting_since")

    def __init__(self, call: dict, fut: asyncio.Future):
        self.call = call
        self.fut = fut
        self.attempts = 0
        self.sent_at = 0.0
        self.sent_before = False   # sent at least once to a service that then failed: it may have run
        self.waiting_since = 0.0   # when it began waiting for a service to come back (never sent, attempts spent)
        self.size = sum(len(v) for v in (call.get("code"), call.get("stdin")) if isinstance(v, str)) + 128


class _Node:
    def __init__(self, host: str, port: int, workers: int = 1, timeout_s: float | None = None):
        self.host, self.port, self.workers = host, int(port), max(1, int(workers or 1))
        self.timeout_s = timeout_s          # the service's default call time limit, if announced
        self.last_reply = 0.0
        self.key = f"{host}:{port}"
        self.queue: collections.deque[_Pending] = collections.deque()
        self.inflight: dict[int, list] = {}
        self.control: dict[int, asyncio.Future] = {}
        self.outstanding = 0
        self.wake = asyncio.Event()
        self.writer: asyncio.StreamWriter | None = None
        self.down_until = 0.0
        self.failures = 0
        self.sender: asyncio.Task | None = None
        self.reader: asyncio.Task | None = None

    @property
    def load(self) -> float:
        return self.outstanding / self.workers

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until


class SandboxClient:
    def __init__(self, addresses: list[str] | None = None, run_dir: str | None = None, *,
                 max_batch: int = MAX_BATCH, max_attempts: int = 3, max_frame_bytes: int = 16 << 20,
                 connect_timeout_s: float = 5.0, refresh_s: float = 10.0, default_timeout_s: float = 4.0,
                 reply_margin_s: float = 30.0, service_wait_s: float = 120.0):
        if not addresses and not run_dir:
            raise ValueError("SandboxClient needs addresses=[host:port, ...] or run_dir= (announcements)")
        self.max_batch = min(max_batch, MAX_BATCH)
        self.max_attempts = max_attempts
        self.max_frame_bytes = max_frame_bytes
        self.connect_timeout_s = connect_timeout_s
        self.refresh_s = refresh_s
        # a call's time limit when neither it nor the service's announcement says (the services' default)
        self.default_timeout_s = default_timeout_s
        # beyond a call's limit: the service's hang grace, a sandbox restart, a loaded node
        self.reply_margin_s = reply_margin_s
        # a restarted service: the supervisor's restart delay (5 s, doubling) plus a pool's start on a loaded node
        self.service_wait_s = service_wait_s
        self._watchdog: asyncio.Task | None = None
        self.run_dir = run_dir
        self.nodes: dict[str, _Node] = {}
        for a in addresses or []:
            host, _, port = a.rpartition(":")
            self._add(host, int(port))
        self._refreshed = 0.0
        self._rid = itertools.count(1)
        self._pinned: dict[str, str] = {}
        self._seq: collections.Counter = collections.Counter()
        self._closed = False
        self.frames_sent = 0
        self.largest_batch = 0

    # ------------------------------------------------------------ public API
    async def run(self, code: str, stdin: str = "", session: str | None = None, timeout_s: float | None = None,
                  id: object = None) -> dict:
        call = {"id": id, "code": code, "stdin": stdin, "session": session}
        if timeout_s is not None:
            call["timeout_s"] = timeout_s
        return await self.submit(call)

    def submit(self, call: dict) -> asyncio.Future:
        """Queue one call (a dict as in sandbox.protocol) now; the future resolves to its result."""
        fut = asyncio.get_running_loop().create_future()
        if not isinstance(call, dict):
            fut.set_result(make_result(None, "invalid_request", "a call must be a JSON object"))
            return fut
        call = dict(call)
        sid = call.get("session")
        if isinstance(sid, str):
            call["session_seq"] = self._seq[sid]
            self._seq[sid] += 1
        p = _Pending(call, fut)
        if p.size > self.max_frame_bytes:
            fut.set_result(make_result(call.get("id"), "invalid_request",
                                       f"call of {p.size} bytes exceeds max_frame_bytes={self.max_frame_bytes}"))
            return fut
        self._dispatch(p)
        return fut

    async def run_many(self, calls: list[dict]) -> list[dict]:
        return list(await asyncio.gather(*(self.submit(c) for c in calls)))

    async def release(self, *sessions: str, timeout_s: float = 10.0) -> int:
        """End these sessions (their trajectories are over); returns how many a service knew. Never raises:
        a session it could not reach about is freed there anyway once idle (`session_idle_s`)."""
        by_node: dict[str, list[str]] = collections.defaultdict(list)
        for sid in sessions:
            self._seq.pop(sid, None)
            key = self._pinned.pop(sid, None)
            if key is not None and key in self.nodes:
                by_node[key].append(sid)
        released = 0
        for key, sids in by_node.items():
            node = self.nodes[key]
            drop = set(sids)
            for p in [p for p in node.queue if p.call.get("session") in drop]:
                node.queue.remove(p)   # never sent, so it never ran: ordering after the release cannot matter
                node.outstanding -= 1
                if not p.fut.done():
                    p.fut.set_result(make_result(p.call.get("id"), "unavailable", "session released"))
            rid = next(self._rid)
            try:
                await self._ensure_connected(node)
                fut = node.control[rid] = asyncio.get_running_loop().create_future()
                node.writer.write(encode({"op": "release", "rid": rid, "sessions": sids}))
                released += int((await asyncio.wait_for(fut, timeout_s)).get("released") or 0)
            except (OSError, ConnectionError, asyncio.TimeoutError) as e:
                log.warning("sandbox client: could not release %d session(s) on %s: %r", len(sids), key, e)
            finally:
                node.control.pop(rid, None)
        return released

    async def stats(self) -> dict[str, dict]:
        """The stats record of every reachable service, by address."""
        self._maybe_refresh(force=True)
        out = {}
        for node in list(self.nodes.values()):
            try:
                await self._ensure_connected(node)
                rid = next(self._rid)
                fut = node.control[rid] = asyncio.get_running_loop().create_future()
                node.writer.write(encode({"op": "stats", "rid": rid}))
                out[node.key] = (await asyncio.wait_for(fut, 10))["stats"]
            except (OSError, asyncio.TimeoutError, ConnectionError) as e:
                out[node.key] = {"error": repr(e)}
        return out

    async def close(self) -> None:
        if self._pinned and not self._closed:   # sessions their owners never released (cancelled en masse)
            await self.release(*list(self._pinned), timeout_s=2.0)
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        for node in self.nodes.values():
            for t in (node.sender, node.reader):
                if t is not None:
                    t.cancel()
            if node.writer is not None:
                node.writer.close()
            for p in list(node.queue) + [p for b in node.inflight.values() for p in b if p is not None]:
                if not p.fut.done():
                    p.fut.set_result(make_result(p.call.get("id"), "unavailable", "client closed",
                                                 maybe_executed=p.sent_before))

    async def __aenter__(self) -> SandboxClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ placement
    def _add(self, host: str, port: int, workers: int = 1, timeout_s: float | None = None) -> _Node:
        key = f"{host}:{port}"
        node = self.nodes.get(key)
        if node is None:
            node = self.nodes[key] = _Node(host, port, workers, timeout_s)
        else:
            node.workers = max(1, int(workers or node.workers))
            node.timeout_s = timeout_s or node.timeout_s
        return node

    def _maybe_refresh(self, force: bool = False) -> None:
        if not self.run_dir or (not force and time.monotonic() - self._refreshed < self.refresh_s):
            return
        self._refreshed = time.monotonic()
        for rec in read_announcements(self.run_dir, "sandbox"):
            self._add(rec["host"], rec["port"], rec.get("workers", 1), rec.get("timeout_s"))

    def _choose(self, p: _Pending) -> _Node | None:
        self._maybe_refresh(force=not self.nodes)
        if not self.nodes:
            return None
        sid = p.call.get("session")
        if sid is not None and sid in self._pinned:
            node = self.nodes.get(self._pinned[sid])
            if node is not None and node.up:
                return node
        up = [n for n in self.nodes.values() if n.up]
        node = min(up, key=lambda n: n.load) if up else min(self.nodes.values(), key=lambda n: n.down_until)
        if sid is not None:
            self._pinned[sid] = node.key
        return node

    def _dispatch(self, p: _Pending) -> None:
        if self._closed:
            p.fut.set_result(make_result(p.call.get("id"), "unavailable", "client closed"))
            return
        node = self._choose(p)
        if node is None:
            self._give_up(p, "no sandbox service found" + (f" in {self.run_dir}/rendezvous/sandbox"
                                                            if self.run_dir else ""))
            return
        node.queue.append(p)
        node.outstanding += 1
        node.wake.set()
        if node.sender is None or node.sender.done():
            node.sender = asyncio.create_task(self._sender(node))
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.create_task(self._watch())

    def _give_up(self, p: _Pending, why: str) -> None:
        if p.fut.done():
            return
        status = "internal_error" if p.sent_before else "unavailable"
        p.fut.set_result(make_result(p.call.get("id"), status, why, attempts=max(1, p.attempts),
                                     maybe_executed=p.sent_before, maybe_executed_before=p.sent_before))

    def _retry(self, p: _Pending, why: str) -> None:
        if p.attempts >= self.max_attempts:
            if not p.sent_before and self._wait_for_service(p, why):
                return
            self._give_up(p, f"{why} (gave up after {p.attempts} attempts)")
            return
        self._dispatch(p)

    def _wait_for_service(self, p: _Pending, why: str) -> bool:
        """A never-sent call whose attempts are spent: try again in a second, with the announcements re-read,
        while it has waited less than service_wait_s (only with a run directory: nothing else can announce a
        restarted service). False when it should be given up."""
        now = time.monotonic()
        if not self.run_dir or self._closed:
            return False
        first = not p.waiting_since
        p.waiting_since = p.waiting_since or now
        if now - p.waiting_since >= self.service_wait_s or p.fut.done():
            return False
        if first:
            log.warning("sandbox client: no service reachable (%s); waiting up to %.0f s for one to come back",
                        why, self.service_wait_s)

        def again() -> None:
            if p.fut.done():   # its caller gave up on it (max_tool_wait_s): never send it
                return
            self._maybe_refresh(force=True)
            p.attempts = self.max_attempts - 1   # one more try; failing, it comes back here
            self._dispatch(p)
        asyncio.get_running_loop().call_later(1.0, again)
        return True

    # ------------------------------------------------------------ connection and I/O
    async def _ensure_connected(self, node: _Node) -> None:
        if node.writer is not None and not node.writer.is_closing():
            return
        wait = node.down_until - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(node.host, node.port, limit=1 << 26),
                                                self.connect_timeout_s)
        node.writer = writer
        node.reader = asyncio.create_task(self._reader(node, reader, writer))

    async def _sender(self, node: _Node) -> None:
        while True:
            if not node.queue:
                node.wake.clear()
                await node.wake.wait()
                continue
            try:
                await self._ensure_connected(node)
            except (OSError, asyncio.TimeoutError) as e:
                self._node_failed(node, f"cannot connect to {node.key}: {e!r}")
                continue
            batch: list = []
            size = 0
            while node.queue and len(batch) < self.max_batch and size + node.queue[0].size <= self.max_frame_bytes:
                p = node.queue.popleft()
                p.attempts += 1
                p.sent_at = time.monotonic()
                batch.append(p)
                size += p.size
            rid = next(self._rid)
            node.inflight[rid] = batch
            self.frames_sent += 1
            self.largest_batch = max(self.largest_batch, len(batch))
            try:
                node.writer.write(encode({"op": "exec", "rid": rid, "calls": [p.call for p in batch]}))
                await node.writer.drain()
            except (OSError, ConnectionError) as e:
                self._node_failed(node, f"send to {node.key} failed: {e!r}")

    async def _reader(self, node: _Node, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                frame = await read_frame(reader, 1 << 30)
                if frame is None:
                    raise ConnectionError("service closed the connection")
                rid = frame.get("rid")
                node.last_reply = time.monotonic()
                if rid in node.control:
                    fut = node.control.pop(rid)
                    if not fut.done():
                        fut.set_result(frame)
                    continue
                batch = node.inflight.get(rid)
                if batch is None:
                    if "error" in frame:
                        raise ConnectionError(f"service rejected a frame: {frame['error']}")
                    continue
                if "error" in frame:   # the whole frame was refused; nothing of it ran
                    for p in batch:
                        if p is not None:
                            node.outstanding -= 1
                            self._give_up(p, f"service refused the request: {frame['error']}")
                    del node.inflight[rid]
                    continue
                i = frame.get("i")
                p = batch[i]
                batch[i] = None
                if all(x is None for x in batch):
                    del node.inflight[rid]
                node.outstanding -= 1
                node.failures = 0
                frame["result"]["node"] = node.key
                self._complete(p, frame["result"])
        except asyncio.CancelledError:
            raise
        except (OSError, ConnectionError, ValueError, asyncio.IncompleteReadError) as e:
            if node.writer is writer:
                self._node_failed(node, f"connection to {node.key} lost: {e!r}")

    def _deadline(self, node: _Node, p: _Pending) -> float:
        limit = p.call.get("timeout_s")
        if not isinstance(limit, (int, float)) or isinstance(limit, bool):
            limit = node.timeout_s or self.default_timeout_s
        return max(p.sent_at, node.last_reply) + float(limit) + self.reply_margin_s

    async def _watch(self) -> None:
        """Fail a service that holds a call past its deadline without answering anything (frozen)."""
        tick = max(0.05, min(1.0, self.reply_margin_s / 4))
        while not self._closed:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for node in list(self.nodes.values()):
                late = next((p for b in node.inflight.values() for p in b
                             if p is not None and now > self._deadline(node, p)), None)
                if late is not None:
                    quiet = now - max(late.sent_at, node.last_reply)
                    self._node_failed(node, f"{node.key} sent nothing for {quiet:.1f} s while holding a call past "
                                            "its time limit + reply_margin_s: frozen?")

    def _complete(self, p: _Pending, result: dict) -> None:
        status = result.get("status")
        if status == "unavailable" or (status == "internal_error" and result.get("maybe_executed")):
            # infrastructure, not user code: try another service (flagged if it may have run)
            p.sent_before = p.sent_before or bool(result.get("maybe_executed"))
            self._retry(p, result.get("reason") or status)
            return
        result["attempts"] = p.attempts
        if p.sent_before:
            result["maybe_executed_before"] = True
        if not p.fut.done():
            p.fut.set_result(result)

    def _node_failed(self, node: _Node, why: str) -> None:
        log.warning("sandbox client: %s", why)
        node.failures += 1
        node.down_until = time.monotonic() + min(0.2 * 2 ** node.failures, 10.0)
        if node.writer is not None:
            node.writer.close()
            node.writer = None
        if node.reader is not None and node.reader is not asyncio.current_task():
            node.reader.cancel()
        node.reader = None
        for sid, key in list(self._pinned.items()):
            if key == node.key:
                del self._pinned[sid]   # its next cell runs elsewhere, reported as state "lost"
        for fut in node.control.values():
            if not fut.done():
                fut.set_exception(ConnectionError(why))
        node.control.clear()
        sent = [p for b in node.inflight.values() for p in b if p is not None]
        unsent = list(node.queue)
        node.inflight.clear()
        node.queue.clear()
        node.outstanding = 0
        self._maybe_refresh(force=True)
        for p in sent:
            p.sent_before = True
            self._retry(p, why)
        for p in unsent:
            p.attempts += 1   # never sent, so it cannot have run; still bounded when every service is down
            self._retry(p, why)
