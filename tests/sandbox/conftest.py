"""Fixtures for the sandbox tests: one real pool (real bwrap) shared by the session, driven from sync tests
through an event loop in a background thread (tests/helpers/sandbox_pools.py)."""
from __future__ import annotations

import os
import time

import pytest

from tests.helpers.sandbox_pools import PER_SANDBOX, host_processes, make_pool


@pytest.fixture(scope="session")
def sb():
    p = make_pool()
    yield p
    p.close()


@pytest.fixture
def healthy(sb):
    """Yields the pool; afterwards the service must be unaffected: every sandbox alive, an ordinary call
    correct and fast, and nothing the hostile call started still running."""
    yield sb
    for code, kind in (("print(6 * 7)", "light"), ("import sympy\nprint(6 * 7)", "math")) * 2:   # every sandbox
        # a generous limit: stuck behind what the hostile call left, the call times out at it; a starved one
        # finishes. A CI run had this check's sympy call finish ("42") past the pool's 2 s limit while two
        # launched runs loaded the 2 cores. The speed of a warm call is bench/sandbox_service.py's figure
        r = sb.run(code, timeout_s=20.0)
        assert r["status"] == "ok" and r["stdout"] == "42\n" and r["sandbox"] == kind, r
        assert r["wall_s"] < 15.0, r
    snap = sb.snapshot()
    assert snap["workers_alive"] == snap["workers"] == 2, snap
    assert snap["light_workers_alive"] == snap["light_workers"] == 2, snap
    if os.geteuid() == 0:
        # per sandbox pid 1, its fork server and the pre-forked next cell, and live session holders: nothing else
        most = PER_SANDBOX * 4 + snap["sessions_live"]
        deadline = time.monotonic() + 2
        while True:
            procs = host_processes(sb.uids())
            if len(procs) <= most or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(procs) <= most, procs
