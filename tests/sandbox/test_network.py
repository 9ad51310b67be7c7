"""The network path: real services on loopback, announced in a run directory, and the batching client."""
from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandbox.client import SandboxClient
from sandbox.limits import Limits
from sandbox.server import Service
from tests.helpers.sandbox_pools import TEST_LIMITS, LoopThread, host_processes

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two services (one sandbox each) on loopback, announced in a run directory; a loop thread to drive them."""
    run_dir = tmp_path_factory.mktemp("run")
    lt = LoopThread()
    services = []
    for name in ("nodeA", "nodeB"):
        svc = Service(Limits(**{**TEST_LIMITS, "num_workers": 1}), host="127.0.0.1", run_dir=str(run_dir),
                      name=name, stats_interval_s=0.5)
        lt.call(svc.start())
        services.append(svc)
    yield lt, services, run_dir
    for svc in services:
        lt.call(svc.close())
    lt.stop()


def with_client(lt, coro_fn, **kw):
    async def go():
        async with SandboxClient(**kw) as c:
            return await coro_fn(c)
    return lt.call(go())


def total_calls(lt, services):
    async def snap():
        return sum(s.pool.snapshot()["calls"] for s in services)
    return lt.call(snap())


def test_services_announce_themselves_and_write_stats(cluster):
    _, services, run_dir = cluster
    for svc in services:
        rec = json.loads((run_dir / "rendezvous" / "sandbox" / f"{svc.name}.json").read_text())
        for key in ("role", "name", "host", "port", "pid", "slurm_job_id", "started_at", "updated_at"):
            assert key in rec, rec
        assert rec["role"] == "sandbox" and rec["host"] == "127.0.0.1" and rec["port"] == svc.port
        assert rec["workers"] == 1
    time.sleep(1.2)
    stats = json.loads((run_dir / "sandbox" / "stats" / "nodeA.json").read_text())
    assert {"queue_depth", "in_flight", "latency_hist", "by_status", "p50_ms"} <= set(stats)


def test_batch_is_spread_over_nodes_in_frames_of_at_most_64(cluster):
    lt, services, run_dir = cluster

    async def go(c):
        rs = await c.run_many([{"id": i, "code": f"{i} * 2"} for i in range(150)])
        return rs, c.frames_sent, c.largest_batch
    rs, frames, largest = with_client(lt, go, run_dir=str(run_dir))
    assert [r["stdout"] for r in rs] == [f"{2 * i}\n" for i in range(150)]
    assert [r["id"] for r in rs] == list(range(150))
    assert {r["node"] for r in rs} == {f"127.0.0.1:{s.port}" for s in services}
    assert largest <= 64 and frames >= 3


def test_a_lone_call_is_sent_without_waiting_for_a_batch(cluster):
    lt, services, run_dir = cluster

    async def go(c):
        await c.run("0")   # connect
        t = time.monotonic()
        r = await c.run("print('alone')")
        return r, time.monotonic() - t
    r, dt = with_client(lt, go, run_dir=str(run_dir))
    assert r["stdout"] == "alone\n" and dt < 2.0, (r, dt)   # no batch window to wait for (a loaded machine: ~0.5 s)


def test_a_session_stays_on_its_node(cluster):
    lt, services, run_dir = cluster

    async def go(c):
        out = [await c.run("acc = []", session="traj-1")]
        for i in range(8):
            out.append(await c.run(f"acc.append({i})\nlen(acc)", session="traj-1"))
            await c.run_many([{"code": "1"} for _ in range(4)])   # load that could pull it elsewhere
        return out
    rs = with_client(lt, go, run_dir=str(run_dir))
    assert len({r["node"] for r in rs}) == 1
    assert rs[-1]["stdout"] == "8\n" and rs[-1]["session"]["state"] == "live"


def test_user_code_failures_are_not_retried(cluster):
    lt, services, run_dir = cluster
    before = total_calls(lt, services)

    async def go(c):
        return await c.run_many([{"code": "1/0"}, {"code": "import time\ntime.sleep(5)", "timeout_s": 0.3},
                                 {"code": "x = bytearray(10**10)"}, {"code": "import os\nos._exit(3)"}])
    rs = with_client(lt, go, run_dir=str(run_dir))
    assert [r["status"] for r in rs] == ["error", "timeout", "memory", "error"]
    assert all(r["attempts"] == 1 and not r.get("maybe_executed_before") for r in rs)
    assert total_calls(lt, services) - before == 4   # each ran exactly once


def test_malformed_calls_in_a_batch_do_not_stop_the_others(cluster):
    lt, services, run_dir = cluster

    async def go(c):
        return await c.run_many([{"code": "print(1)"}, {"code": 5}, {"code": "x", "timeout_s": -1},
                                 {"code": "print(2)", "bogus": 1}, {"code": "\x00"}, {"code": "print(3)"}])
    rs = with_client(lt, go, run_dir=str(run_dir))
    assert [r["status"] for r in rs] == ["ok", "invalid_request", "invalid_request", "invalid_request",
                                         "invalid_request", "ok"]
    assert all(r["reason"] for r in rs[1:5])


def _frame(obj) -> bytes:
    body = json.dumps(obj).encode() if not isinstance(obj, bytes) else obj
    return struct.pack(">I", len(body)) + body


def _read(sock) -> dict:
    hdr = sock.recv(4, socket.MSG_WAITALL)
    n = struct.unpack(">I", hdr)[0]
    return json.loads(sock.recv(n, socket.MSG_WAITALL))


def test_garbage_frames_get_errors_and_the_connection_survives(cluster):
    lt, services, run_dir = cluster
    with socket.create_connection(("127.0.0.1", services[0].port), timeout=10) as s:
        s.sendall(_frame(b"{not json"))
        assert "not JSON" in _read(s)["error"]
        s.sendall(_frame({"op": "exec", "rid": 1, "calls": "nope"}))
        assert _read(s)["rid"] == 1
        s.sendall(_frame({"op": "exec", "rid": 2, "calls": [{"code": "6*7"}]}))
        assert _read(s)["result"]["stdout"] == "42\n"
        s.sendall(struct.pack(">I", 1 << 30))   # a frame over max_request_bytes: error, then closed
        assert "exceeds" in _read(s)["error"]
        assert s.recv(1) == b""


def test_stats_request(cluster):
    lt, services, run_dir = cluster
    stats = with_client(lt, lambda c: c.stats(), run_dir=str(run_dir))
    assert len(stats) == 2
    for st in stats.values():
        assert st["workers_alive"] == 1 and st["calls"] > 0 and "queue_depth" in st


def test_a_stale_announcement_is_skipped(cluster):
    lt, services, run_dir = cluster
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()   # nothing listens there now
    stale = run_dir / "rendezvous" / "sandbox" / "ghost.json"
    stale.write_text(json.dumps({"role": "sandbox", "name": "ghost", "host": "127.0.0.1", "port": port,
                                 "pid": 1, "slurm_job_id": None, "started_at": 0, "updated_at": 0, "workers": 64}))
    try:
        rs = with_client(lt, lambda c: c.run_many([{"code": "1"} for _ in range(20)]), run_dir=str(run_dir))
        assert all(r["status"] == "ok" for r in rs), rs
        assert not any(r.get("maybe_executed_before") for r in rs)   # never sent: retried silently
    finally:
        stale.unlink()


def test_killed_service_calls_move_to_another_node_and_say_so(cluster, tmp_path):
    """A service SIGKILLed mid-batch: every call still gets a result from the live node; calls that were in
    flight on the dead one are flagged maybe_executed_before; its sandboxes die with it."""
    lt, services, run_dir = cluster
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", "from rstar_hpc.cli import main; main()", "sandbox", "serve",
                             "--workers", "1", "--host", "127.0.0.1", "--name", "victim", "--run-dir", str(run_dir)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ann = run_dir / "rendezvous" / "sandbox" / "victim.json"
    try:
        deadline = time.monotonic() + 60
        while not ann.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "victim service did not start"
            time.sleep(0.1)
        victim = f"127.0.0.1:{json.loads(ann.read_text())['port']}"
        victim_uid = Limits().root_uid_base + (proc.pid % 100_000) * 1000   # pool.sandbox_uid, index 0

        async def go(c):
            futs = [c.submit({"id": i, "code": "import time\ntime.sleep(0.4)\nprint('done')"}) for i in range(12)]
            import asyncio
            await asyncio.sleep(0.6)
            os.kill(proc.pid, signal.SIGKILL)
            return await asyncio.gather(*futs)
        rs = with_client(lt, go, addresses=[victim] + [f"127.0.0.1:{s.port}" for s in services])
    finally:
        proc.kill()
        proc.wait()
        ann.unlink(missing_ok=True)
    _assert_moved_off(rs, victim)
    if os.geteuid() == 0:   # --die-with-parent takes its sandbox down (on a loaded machine in a second or more)
        deadline = time.monotonic() + 15
        while host_processes({victim_uid}) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert host_processes({victim_uid}) == []


def _assert_moved_off(rs, victim):
    """Every call got its result from a live node; those that were on the victim moved, and exactly the moved
    ones may be flagged maybe_executed_before (at least one was running there when it went)."""
    assert all(r["status"] == "ok" and r["stdout"] == "done\n" for r in rs), rs
    moved = [r for r in rs if r["attempts"] > 1]
    assert moved, "some calls must have been on the victim"
    assert all(r["node"] != victim for r in moved)
    assert any(r.get("maybe_executed_before") for r in moved)
    assert not any(r.get("maybe_executed_before") for r in rs if r["attempts"] == 1)


def _start_victim(run_dir, name):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", "from rstar_hpc.cli import main; main()", "sandbox", "serve",
                             "--workers", "1", "--host", "127.0.0.1", "--name", name, "--run-dir", str(run_dir)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ann = run_dir / "rendezvous" / "sandbox" / f"{name}.json"
    deadline = time.monotonic() + 60
    while not ann.exists():
        assert time.monotonic() < deadline and proc.poll() is None, f"{name} service did not start"
        time.sleep(0.1)
    return proc, ann, f"127.0.0.1:{json.loads(ann.read_text())['port']}"


def test_frozen_service_calls_move_to_another_node_and_say_so(cluster):
    """A service SIGSTOPped mid-batch (alive, connection open, silent): once a call it holds outlives its time
    limit + reply_margin_s, the client treats it as failed; every call still gets a result from a live node,
    and the ones that were in flight on the frozen node are flagged maybe_executed_before."""
    lt, services, run_dir = cluster
    proc, ann, victim = _start_victim(run_dir, "frozen")
    try:
        async def go(c):
            import asyncio
            await c.run("0")   # connected to every node
            futs = [c.submit({"id": i, "code": "import time\ntime.sleep(0.4)\nprint('done')", "timeout_s": 1.0})
                    for i in range(12)]
            await asyncio.sleep(0.6)
            os.kill(proc.pid, signal.SIGSTOP)
            t = time.monotonic()
            rs = await asyncio.gather(*futs)
            return rs, time.monotonic() - t
        rs, waited = with_client(lt, go, addresses=[victim] + [f"127.0.0.1:{s.port}" for s in services],
                                 reply_margin_s=1.0)
    finally:
        proc.kill()   # SIGKILL works on a stopped process
        proc.wait()
        ann.unlink(missing_ok=True)
    _assert_moved_off(rs, victim)
    assert waited < 1.0 + 1.0 + 10, waited   # limit + margin, plus the reruns on two loaded nodes


def test_a_busy_service_is_not_taken_for_a_frozen_one(cluster):
    """Calls queued behind others on one node wait longer than their own limit + margin, but the service keeps
    answering: nothing may be retried."""
    lt, services, run_dir = cluster

    async def go(c):
        return await c.run_many([{"code": "import time\ntime.sleep(0.3)", "timeout_s": 0.5} for _ in range(16)])
    rs = with_client(lt, go, addresses=[f"127.0.0.1:{services[0].port}"], reply_margin_s=1.0)
    # one node, one light sandbox: about 16 x 0.3 s in a row, far past 0.5 + 1 s for the last ones
    assert all(r["status"] == "ok" and r["attempts"] == 1 for r in rs), rs


def test_a_service_holding_calls_that_never_finish_stops_its_heartbeat(tmp_path, monkeypatch):
    """Progress, not presence: the announcement (the sandbox role's heartbeat) is refreshed while calls finish or
    none is held, and left to go stale once calls are held with none finishing for stall_s; it comes back when
    one finishes. The stats file says how long."""
    from rstar_hpc.exchange.rendezvous import announcement_path

    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    svc = Service(Limits(**{**TEST_LIMITS, "num_workers": 1, "max_timeout_s": 10.0}), host="127.0.0.1",
                  run_dir=str(tmp_path), name="stuck", port=1)
    svc.port = 4242
    snap = {"calls": 5, "in_flight": 0, "queue_depth": 0, "workers": 1}
    monkeypatch.setattr(svc.pool, "snapshot", lambda: dict(snap))   # an unstarted pool: its figures scripted
    monkeypatch.setattr(svc, "stats", lambda: dict(snap))
    path = announcement_path(tmp_path, "sandbox", "stuck")

    def beat(after_s: float) -> float | None:
        """Publish `after_s` later; the announcement's refresh time if it was refreshed, else None."""
        now[0] += after_s
        before = json.loads(open(path).read())["updated_at"] if os.path.exists(path) else None
        time.sleep(0.01)   # a refresh is seen by its updated_at (wall clock)
        svc._publish()
        after = json.loads(open(path).read())["updated_at"]
        return None if after == before else after

    assert beat(0) and beat(300)                               # idle: present is enough
    snap.update(in_flight=1, queue_depth=3)
    assert beat(1) and beat(15) and beat(3)                    # holding calls, none finished for 19 s <= 20
    # (counted from the last publish that saw it idle or moving)
    assert beat(2) is None                                     # 21 s: stuck, the heartbeat stops
    stats = json.loads((tmp_path / "sandbox" / "stats" / "stuck.json").read_text())
    assert stats["stalled_s"] == 21.0 and stats["in_flight"] == 1
    snap.update(calls=6)                                       # one finished: moving again
    assert beat(1)
