"""The per-node service: a Pool behind an asyncio TCP server, announced in the run directory.

No extra daemon: the service is one Python process (plus its sandboxes) started by the sbatch template on
each CPU node. It writes `<run_dir>/rendezvous/sandbox/<name>.json` (host, port, workers, load) and
refreshes it as a heartbeat; clients find services there. Every `stats_interval_s` it logs one summary
line and writes `<run_dir>/sandbox/stats/<name>.json`; `{"op": "stats"}` returns the same record.

The heartbeat says progress, not presence: while the pool holds calls (running or queued) and none finishes for
`stall_s` (twice the longest time limit a call may ask for: every call ends within its limit, its sandbox killed
if need be), the service stops refreshing its announcement. Clients then skip it and the launcher restarts it as
a hung role (launch.hang_timeout_s), as it does a rollout whose engines stopped moving.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from rstar_hpc.exchange.atomic import atomic_write_text
from rstar_hpc.exchange.rendezvous import announce
from sandbox.limits import Limits
from sandbox.pool import Pool
from sandbox.protocol import MAX_BATCH, FrameTooLarge, encode, read_frame, validate_call
from sandbox.results import make_result

log = logging.getLogger("sandbox")
T = TypeVar("T")
COALESCE_S = 0.002   # results finishing this soon after the last write to a client share the next write


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` on uvloop where it is installed, on asyncio's own loop otherwise. A call crosses the
    service's loop four times (request frame, sandbox pipe out and back, result frame): on uvloop a warm
    trivial call takes ~0.5 ms less of its ~2.8 ms at concurrency 1 (bench/sandbox_service.py)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _announce(run_dir: str, name: str, host: str, port: int, **extra: object) -> None:
    announce(run_dir, "sandbox", name, port, host=host, **extra)


class Service:
    def __init__(self, limits: Limits | None = None, *, host: str = "0.0.0.0", port: int = 0,
                 run_dir: str | None = None, name: str | None = None, announce_host: str | None = None,
                 stats_interval_s: float = 30.0, seccomp: bool = True):
        self.limits = limits or Limits()
        self.pool = Pool(self.limits, seccomp=seccomp)
        self.host, self.port = host, port
        self.run_dir = run_dir
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.announce_host = announce_host or (host if host not in ("0.0.0.0", "::", "") else socket.gethostname())
        self.stats_interval_s = stats_interval_s
        self._server: asyncio.base_events.Server | None = None
        self._tasks: list[asyncio.Task] = []
        self.connections = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self.stall_s = 2 * self.limits.max_timeout_s
        self._moved: tuple[int | None, float] = (None, time.monotonic())   # (calls finished, when last moved or idle)

    @property
    def address(self) -> str:
        return f"{self.announce_host}:{self.port}"

    async def start(self) -> None:
        await self.pool.start()
        self._server = await asyncio.start_server(self._connection, self.host, self.port, limit=1 << 20)
        self.port = self._server.sockets[0].getsockname()[1]
        self._publish()
        self._tasks.append(asyncio.create_task(self._periodic()))
        log.info("sandbox service %s listening on %s (%d math + %d light sandboxes)", self.name, self.address,
                 len(self.pool.math_slots), len(self.pool.light_slots))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        if self.run_dir:
            try:
                os.unlink(os.path.join(self.run_dir, "rendezvous", "sandbox", self.name + ".json"))
            except OSError:
                pass
        await self.pool.close()

    async def serve_forever(self) -> None:
        """Run until SIGTERM/SIGINT (what Slurm sends at the end of a job step). The handlers come first: a step
        stopped while the pool starts ends the service cleanly rather than by the signal's default action."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            starting = asyncio.ensure_future(self.start())
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait((starting, stopped), return_when=asyncio.FIRST_COMPLETED)
            if stopped.done():   # stopped while starting: the start unwinds before the pool closes
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
            else:
                starting.result()   # a start that failed raises here
                await stopped
        finally:
            self._log_summary()
            await self.close()

    # ------------------------------------------------------------ stats
    def stats(self) -> dict:
        snap = self.pool.snapshot()
        snap.update(name=self.name, address=self.address, connections=self.connections, time=time.time())
        return snap

    def stalled_s(self, snap: dict) -> float:
        """How long the pool has held calls with none finishing (0.0 while it is idle or moving)."""
        now = time.monotonic()
        calls, since = self._moved
        if snap["calls"] != calls or not (snap["in_flight"] or snap["queue_depth"]):
            self._moved = (snap["calls"], now)
            return 0.0
        return now - since

    def _publish(self) -> None:
        if not self.run_dir:
            return
        snap = self.pool.snapshot()
        stalled = self.stalled_s(snap)
        if stalled <= self.stall_s:
            _announce(self.run_dir, self.name, self.announce_host, self.port, workers=snap["workers"],
                      queue_depth=snap["queue_depth"], in_flight=snap["in_flight"], timeout_s=self.limits.timeout_s)
        else:
            log.error("sandbox %s: %d calls running and %d queued, none finished for %.0fs (more than %.0fs, twice "
                      "the longest call limit): its workers are stuck; not refreshing its announcement, so clients "
                      "skip it and the launcher restarts it", self.name, snap["in_flight"], snap["queue_depth"],
                      stalled, self.stall_s)
        folder = os.path.join(self.run_dir, "sandbox", "stats")
        os.makedirs(folder, exist_ok=True)
        atomic_write_text(os.path.join(folder, self.name + ".json"),
                          json.dumps({**self.stats(), "stalled_s": round(stalled, 1)}, indent=1) + "\n")

    def _log_summary(self) -> None:
        s = self.stats()
        by = " ".join(f"{k}={v}" for k, v in s["by_status"].items() if v)
        log.info("sandbox %s: calls=%d queue=%d in_flight=%d workers=%d/%d p50=%sms p99=%sms sessions=%d "
                 "restarts=%s evictions=%s %s", self.name, s["calls"], s["queue_depth"], s["in_flight"],
                 s["workers_alive"], s["workers"], s["p50_ms"], s["p99_ms"], s["sessions_live"],
                 sum(s["restarts"].values()), sum(s["evictions"].values()), by)

    async def _periodic(self) -> None:
        while True:
            await asyncio.sleep(self.stats_interval_s)
            try:
                self._log_summary()
                self._publish()
            except OSError as e:   # shared storage hiccups must not stop the service
                log.warning("sandbox %s: could not publish stats: %s", self.name, e)

    # ------------------------------------------------------------ connections
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        loop = asyncio.get_running_loop()
        pending: list[bytes] = []
        armed, last = False, 0.0

        def flush() -> None:
            nonlocal armed, last
            armed = False
            if pending and not writer.is_closing():
                writer.write(b"".join(pending))
                last = loop.time()
            pending.clear()

        def send(obj: dict) -> None:
            # one write (a TCP segment, a wake-up of the client) for the results that finish within
            # COALESCE_S of the previous write, instead of one each; an idle connection's result goes out at once
            nonlocal armed
            if writer.is_closing():
                return
            pending.append(encode(obj))
            if not armed:
                armed = True
                wait = COALESCE_S - (loop.time() - last)
                if wait > 0:
                    loop.call_later(wait, flush)
                else:
                    loop.call_soon(flush)

        try:
            while True:
                try:
                    frame = await read_frame(reader, self.limits.max_request_bytes)
                except FrameTooLarge as e:
                    send({"rid": None, "error": str(e)})
                    break   # the rest of the stream is unframed now
                except ValueError as e:
                    send({"rid": None, "error": f"frame is not JSON: {e}"})
                    continue
                if frame is None:
                    break
                if not isinstance(frame, dict):
                    send({"rid": None, "error": "a frame must be a JSON object"})
                    continue
                rid, op = frame.get("rid"), frame.get("op")
                if op == "exec":
                    self._exec(rid, frame.get("calls"), send)
                elif op == "stats":
                    send({"rid": rid, "stats": self.stats()})
                elif op == "ping":
                    send({"rid": rid, "ok": True, "name": self.name})
                elif op == "release":
                    send(self._release(rid, frame.get("sessions")))
                else:
                    send({"rid": rid, "error": f"unknown op {op!r}; ops are exec, release, stats, ping"})
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            flush()
            self.connections -= 1
            self._writers.discard(writer)
            writer.close()

    def _release(self, rid: object, sessions: object) -> dict:
        if not isinstance(sessions, list) or not all(isinstance(s, str) for s in sessions):
            return {"rid": rid, "error": "'sessions' must be a list of session ids"}
        return {"rid": rid, "released": sum(self.pool.release(s) for s in sessions)}

    def _exec(self, rid: object, calls: object, send) -> None:
        if not isinstance(calls, list) or not 0 < len(calls) <= MAX_BATCH:
            send({"rid": rid, "error": f"'calls' must be a list of 1..{MAX_BATCH} calls"})
            return
        for i, obj in enumerate(calls):
            call, bad = validate_call(obj, self.limits)
            if bad is not None:
                self.pool.stats.record(bad, 0.0)
                send({"rid": rid, "i": i, "result": bad})
                continue
            fut = self.pool.submit(call)

            def done(f: asyncio.Future, i: int = i) -> None:
                result = f.result() if not f.cancelled() else make_result(None, "unavailable", "cancelled")
                send({"rid": rid, "i": i, "result": result})
            fut.add_done_callback(done)
