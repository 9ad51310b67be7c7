"""Sessions: notebook-like state per trajectory, ordered, isolated, and evicted/replayed as documented."""
from __future__ import annotations

import os
import select
import socket
import time
import uuid

import pytest

from sandbox.worker.sessions import Sessions
from tests.helpers.sandbox_pools import make_pool


def sid() -> str:
    return "s-" + uuid.uuid4().hex[:8]


def test_state_is_kept_across_cells(healthy):
    s = sid()
    r1 = healthy.run("import numpy as np\nx = np.arange(4)\ndef f(k):\n    return k * 2", session=s)
    r2 = healthy.run("f(int(x.sum()))", session=s)
    assert r1["session"]["state"] == "new" and r2["session"]["state"] == "live", (r1, r2)
    assert r2["status"] == "ok" and r2["stdout"] == "12\n", r2
    assert r2["session"]["cells"] == 2


def test_sessions_are_isolated_from_each_other_and_from_stateless_calls(healthy):
    a, b = sid(), sid()
    healthy.run("secret_a = 41", session=a)
    rb = healthy.run("secret_a", session=b)
    rs = healthy.run("secret_a")
    assert rb["status"] == "error" and rb["exc_type"] == "NameError", rb
    assert rs["status"] == "error" and rs["exc_type"] == "NameError", rs
    assert healthy.run("secret_a + 1", session=a)["stdout"] == "42\n"


def test_cells_of_a_session_run_in_submission_order(healthy):
    s = sid()
    # a generous limit per cell: the test is about order, and a CI run on the loaded 2 cores had one trivial cell
    # (of 22 queued at once) miss the pool's 2 s and roll back, so its number was missing from `seen`
    calls = [{"code": "seen = []", "session": s}] + [{"code": f"seen.append({i})", "session": s} for i in range(20)]
    calls.append({"code": "seen", "session": s})
    rs = healthy.run_many([{**c, "timeout_s": 20.0} for c in calls])
    assert [(i, r["status"]) for i, r in enumerate(rs) if r["status"] != "ok"] == [], rs
    assert rs[-1]["stdout"] == repr(list(range(20))) + "\n", rs[-1]
    assert [r["session"]["cells"] for r in rs] == list(range(1, 23))


def test_exception_keeps_partial_state_like_ipython(healthy):
    s = sid()
    r = healthy.run("a = 1\n1 / 0\nb = 2", session=s)
    assert r["status"] == "error" and not r["session"]["rolled_back"], r
    assert healthy.run("a", session=s)["stdout"] == "1\n"


@pytest.mark.parametrize("killer", ["import os\nos._exit(0)", "import time\ntime.sleep(5)",
                                    "import ctypes\nctypes.string_at(0)", "x = bytearray(10**10)\nkeep = 0"])
def test_a_cell_that_dies_rolls_the_session_back(healthy, killer):
    s = sid()
    healthy.run("keep = 'before'", session=s)
    r = healthy.run("keep = 'changed'\n" + killer, session=s, timeout_s=0.7)
    after = healthy.run("keep", session=s)
    if r["status"] == "memory":   # MemoryError is an exception, not a death: state as left by the cell
        assert after["stdout"] == "'changed'\n", after
        return
    assert r["session"]["rolled_back"], r
    assert after["status"] == "ok" and after["stdout"] == "'before'\n", (r, after)
    # the sandbox outlives the cell (its session process is replaced: live), or, on a loaded machine, its answer comes
    # after limits.hang_grace_s and the whole sandbox is replaced (internal_error): the session is then replayed
    assert after["session"]["state"] == ("replayed" if r["status"] == "internal_error" else "live"), (r, after)


def test_stdin_per_cell_in_a_session(healthy):
    s = sid()
    healthy.run("total = 0", session=s)
    healthy.run("total += int(input())", session=s, stdin="5\n")
    assert healthy.run("total += int(input())\ntotal", session=s, stdin="7\n")["stdout"] == "12\n"


def test_a_session_killed_by_another_session_is_replayed_and_flagged(healthy):
    victim, attacker = sid(), sid()
    healthy.run("import os\nv = 7\nmy_pid = os.getpid()", session=victim)
    pid = int(healthy.run("my_pid", session=victim)["stdout"])
    # the attacker may land in the other sandbox: try until it hits (pids are per sandbox)
    healthy.run(f"import os, signal\ntry:\n    os.kill({pid}, signal.SIGKILL)\nexcept OSError:\n    pass",
                session=attacker)
    r = healthy.run("v * 6", session=victim)
    assert r["status"] == "ok" and r["stdout"] == "42\n", r
    assert r["session"]["state"] in ("live", "replayed"), r


def test_unknown_session_with_earlier_cells_is_reported_lost(healthy):
    from sandbox.protocol import validate_call
    call, _ = validate_call({"code": "1", "session": sid(), "session_seq": 3}, healthy.pool.limits)
    r = healthy.lt.call(healthy.pool.run(call))
    assert r["status"] == "ok" and r["session"]["state"] == "lost" and "3 earlier" in r["session"]["note"], r


def test_idle_eviction_then_replay():
    p = make_pool(num_workers=1, session_idle_s=0.5)
    try:
        s = sid()
        p.run("import random\nx = 20\nprint('noisy')", session=s)
        p.run("x += 1", session=s)
        # the housekeeper runs every second; the evicted session's record (and history) is forgotten 4 x idle
        # after its last use, so call again as soon as it is evicted, not after a fixed sleep
        deadline = time.monotonic() + 1.9
        while not p.snapshot()["evictions"].get("idle") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.snapshot()["evictions"].get("idle") == 1
        r = p.run("x * 2", session=s)
        assert r["status"] == "ok" and r["stdout"] == "42\n", r   # replay output is not shown
        assert r["session"]["state"] == "replayed" and r["session"]["replayed_cells"] == 2, r
        assert "idle" in r["session"]["note"]
        assert p.run("x", session=s)["session"]["state"] == "live"
    finally:
        p.close()


def test_memory_budget_evicts_least_recently_used():
    p = make_pool(num_workers=1, session_memory_mb=64)
    try:
        old, new = sid(), sid()
        p.run("blob = bytearray(40 * 2**20)\nv = 'old'", session=old)
        p.run("blob = bytearray(40 * 2**20)\nv = 'new'", session=new)
        time.sleep(1.5)
        snap = p.snapshot()
        assert snap["evictions"].get("memory", 0) >= 1, snap
        assert p.run("v", session=new)["session"]["state"] == "live"
        r = p.run("v", session=old)
        assert r["stdout"] == "'old'\n" and r["session"]["state"] == "replayed", r
    finally:
        p.close()


def test_history_over_the_cap_makes_an_evicted_session_lost():
    p = make_pool(num_workers=1, session_idle_s=0.5, max_history_bytes=100)
    try:
        s = sid()
        p.run("x = 1  # " + "y" * 200, session=s)
        time.sleep(2.0)
        r = p.run("x", session=s)
        assert r["session"]["state"] == "lost" and r["exc_type"] == "NameError", r
        assert "max_history_bytes" in r["session"]["note"]
    finally:
        p.close()


def test_capacity_evicts_the_least_recently_used_session():
    p = make_pool(num_workers=1, max_sessions_per_worker=2)
    try:
        ids = [sid() for _ in range(3)]
        for i, s in enumerate(ids):
            p.run(f"v = {i}", session=s)
        assert p.snapshot()["evictions"].get("capacity") == 1
        r = p.run("v", session=ids[0])
        assert r["stdout"] == "0\n" and r["session"]["state"] == "replayed", r
    finally:
        p.close()


def test_recycled_sandbox_replays_its_sessions():
    p = make_pool(num_workers=1, recycle_after=3)
    try:
        s = sid()
        p.run("n = 41", session=s)
        assert p.run("1")["sandbox"] == "light"   # stateless stdlib calls do not count against the math sandbox
        p.run("import sympy\n1")
        p.run("import numpy\n2")   # third call of the math sandbox: it is replaced after it
        r = p.run("n + 1", session=s)
        assert r["stdout"] == "42\n" and r["session"]["state"] == "replayed" and "recycled" in r["session"]["note"], r
        assert p.snapshot()["restarts"].get("recycled") == 1
    finally:
        p.close()


def test_more_sessions_at_once_than_room_wait_for_it_and_keep_their_state():
    """A rollout's burst: 30 trajectories each start a session before any of them ends, on a sandbox that holds 2.
    The sessions beyond the room wait for it (each held one is a process under the sandbox's process limit: taking
    them all at once exhausted it, and cells then lost their state and reported an exception as ok)."""
    # a generous wall limit: on a loaded machine a session cell's process hand-offs alone can take the tests' 2 s
    p = make_pool(num_workers=1, max_sessions_per_worker=2, timeout_s=20.0)
    try:
        ids = [sid() for _ in range(30)]
        rs = p.run_many([{"code": f"x = {i}\nprnt(x)", "session": s} for i, s in enumerate(ids)] +
                        [{"code": "print(x)", "session": s} for s in ids])
        first, second = rs[:30], rs[30:]
        assert all(r["status"] == "error" and r["exc_type"] == "NameError" and r["session"]["state"] == "new"
                   for r in first), [r for r in first if r["status"] != "error"][:2]
        # the message names each failed call's status and reason (a flake under CI's load once lost them to truncation)
        assert [r["stdout"] for r in second] == [f"{i}\n" for i in range(30)], \
            [(i, r["status"], r.get("reason"), r["session"]) for i, r in enumerate(second) if r["stdout"] != f"{i}\n"]
        assert all(r["session"]["state"] == "live" and not r["session"]["rolled_back"] for r in second)
        snap = p.snapshot()
        assert snap["sessions_live"] <= 2 and snap["evictions"].get("capacity", 0) >= 28, snap
    finally:
        p.close()


def _holder_says(peer: socket.socket, cell: int) -> None:
    peer.sendall(b'{"forked": %d}\n' % cell)


def test_pid_1_takes_a_cell_its_holder_already_reaped_and_refuses_a_pid_that_is_not_the_holders_child():
    """The holder reports the cell it forked, then waits for it. A quick cell can end and be reaped before
    pid 1 reads that report (a busy node): it is that cell, exited, not a holder that failed to start one
    (that race lost cells' output and their sessions as internal_error). A live pid that is not the holder's
    child is refused. The real pid-1 code, on host processes: this process plays the holder."""
    ours, peer = socket.socketpair()
    h = {"pid": os.getpid(), "sock": ours, "buf": b""}
    sessions = Sessions(server=None)
    try:
        quick = os.fork()
        if quick == 0:
            os._exit(0)
        os.waitpid(quick, 0)   # reaped: the pid names no process now
        _holder_says(peer, quick)
        cell, fd = sessions.forked(h, 5.0)
        assert cell == quick and fd is not None and select.select([fd], [], [], 0)[0], (cell, fd)
        os.close(fd)

        live = os.fork()
        if live == 0:
            time.sleep(30)
            os._exit(0)
        try:
            _holder_says(peer, live)
            cell, fd = sessions.forked(h, 5.0)
            assert cell == live and not select.select([fd], [], [], 0)[0]   # running: its pidfd is not readable
            os.close(fd)
            h["pid"] = os.getppid()   # the same live process, but the "holder" is now not its parent
            _holder_says(peer, live)
            assert sessions.forked(h, 5.0) == (None, None)
        finally:
            os.kill(live, 9)
            os.waitpid(live, 0)
    finally:
        ours.close()
        peer.close()
