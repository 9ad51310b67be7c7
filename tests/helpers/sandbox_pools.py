"""The sandbox tests' helpers: the test limits, a real pool (real bwrap) driven from sync tests through an event
loop in a background thread, and host-process accounting. conftest.py builds its fixtures from these."""
from __future__ import annotations

import asyncio
import os
import threading

from sandbox.limits import Limits
from sandbox.pool import Pool
from sandbox.protocol import validate_call

# planted in the service's environment before the pool starts: no sandboxed code may ever see it
SECRET = "rstar-test-secret-7f3a9c"
os.environ["RSTAR_SANDBOX_TEST_SECRET"] = SECRET   # at import, before any pool: conftest.py imports this module

# short limits keep the hostile catalogue fast on 2 cores; the mechanisms are the production ones
TEST_LIMITS = dict(num_workers=2, timeout_s=2.0, cpu_time_s=2.0, memory_mb=512, max_processes=16,
                   max_output_bytes=2048, output_kill_bytes=1 << 20, file_size_mb=8, scratch_mb=48,
                   max_code_bytes=1 << 16, max_sessions_per_worker=8)


PER_SANDBOX = 3   # processes a sandbox keeps between calls besides session holders: pid 1, fork server, spare


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class SyncPool:
    """A started Pool plus blocking helpers."""

    def __init__(self, limits: Limits):
        self.lt = LoopThread()
        self.pool = Pool(limits)
        self.lt.call(self.pool.start())

    def run(self, code: str, **kw) -> dict:
        call, bad = validate_call({"id": kw.pop("id", None), "code": code, **kw}, self.pool.limits)
        assert bad is None, bad
        return self.lt.call(self.pool.run(call))

    def run_many(self, calls: list[dict]) -> list[dict]:
        async def go():
            futs = []
            for c in calls:
                call, bad = validate_call(c, self.pool.limits)
                assert bad is None, bad
                futs.append(self.pool.submit(call))
            return await asyncio.gather(*futs)
        return self.lt.call(go())

    def snapshot(self) -> dict:
        return self.lt.call(_snap(self.pool))

    def uids(self) -> set[int]:
        return {s.sandbox.info.get("uid") for s in self.pool.slots}

    def close(self) -> None:
        self.lt.call(self.pool.close())
        self.lt.stop()


async def _snap(pool: Pool) -> dict:
    return pool.snapshot()


def host_processes(uids: set[int]) -> list[int]:
    """Pids on the host owned by the sandboxes' uids (only meaningful when the service runs as root)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid in uids:
                    out.append(int(name))
            except FileNotFoundError:
                pass
    return out


def make_pool(**overrides) -> SyncPool:
    return SyncPool(Limits(**{**TEST_LIMITS, **overrides}))
