"""In-memory weight sync without vLLM: the bucket layout, a real session over gloo between the trainer's
WeightServer and a receiver (both here, each with its own group member), the refusal of a stale version, the
rollout's choice between an in-memory offer and published files, the file-publish cadence and its config check,
and the status line."""
from __future__ import annotations

import json
import threading

import pytest
import torch

from rstar_hpc.exchange import weight_protocol as protocol
from rstar_hpc.exchange.policy_versions import newest_offered_version, next_version, record_offered
from rstar_hpc.exchange.rundir import RunPaths


def test_buckets_keep_order_alignment_and_size():
    specs = [("a", (3,), "float32"), ("b", (5, 2), "bfloat16"), ("big", (100,), "float32"), ("c", (1,), "int64")]
    plan = protocol.plan_buckets(specs, bucket_bytes=64)
    assert [[e.name for e in b] for b in plan] == [["a", "b"], ["big"], ["c"]]   # big alone: larger than a bucket
    a, b = plan[0]
    assert (a.offset, a.nbytes, b.offset, b.nbytes) == (0, 12, 16, 20)          # 8-byte aligned
    assert protocol.bucket_nbytes(plan[0]) == 36 and protocol.layout_from_json(protocol.layout_to_json(plan)) == plan
    with pytest.raises(ValueError, match="dtype 'complex64' cannot be synced"):
        protocol.plan_buckets([("z", (1,), "complex64")], 64)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(50, 16, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g).to(torch.bfloat16),
            "model.norm.weight": torch.randn(16, generator=g)}


def test_session_sends_every_tensor_bitwise_and_refuses_a_stale_version(tmp_path):
    from rstar_hpc.rollout.weight_receiver import SessionRefused, open_session, receive_buckets
    from rstar_hpc.trainer.weight_sender import WeightServer

    server = WeightServer(tmp_path, timeout_s=30, bucket_bytes=2048, host="127.0.0.1")
    try:
        state = _state(0)
        server.offer(4, "rl", 3, state)
        offer = protocol.read_offer(tmp_path)
        assert (offer["version"], offer["stage"], offer["trainer_step"]) == (4, "rl", 3)
        session = open_session(offer, 4, receivers=2)
        got: list[dict] = [{}, {}]
        stats: list[dict] = [{}, {}]

        def receive(k: int) -> None:   # two engine workers, ranks 1 and 2 of the session's group
            for name, t in receive_buckets(session, k + 1, stats[k]):
                got[k][name] = t.clone()
        threads = [threading.Thread(target=receive, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for k in range(2):
            assert got[k].keys() == state.keys()
            for name, t in state.items():
                assert got[k][name].dtype == t.dtype and torch.equal(got[k][name], t), name
        assert stats[0]["bytes"] == server.sessions[-1]["bytes"] > 0 and server.sessions[-1]["receivers"] == 2
        assert len(protocol.layout_from_json(server.store.get(protocol.session_prefix(0) + "layout"))) > 1  # buckets

        server.offer(5, "rl", 4, _state(1))   # the trainer moved on: a request for v4 is refused, with why
        with pytest.raises(SessionRefused, match="holds v5 now, not v4"):
            open_session(offer, 4, receivers=1)
    finally:
        server.close()
    assert protocol.read_offer(tmp_path) is None and newest_offered_version(tmp_path) == 5


def test_rollout_picks_the_newer_of_offer_and_files(tmp_path):
    from rstar_hpc.config.rollout import SchedulerConfig
    from rstar_hpc.pipeline import PolicyNeed
    from rstar_hpc.rollout.policy_source import MEMORY, wait_for_policy

    paths = RunPaths(tmp_path / "run")
    paths.create()
    dirs = paths.policies()
    dirs.commit(1, dirs.begin(1), stage="rl", trainer_step=1)
    sc = SchedulerConfig()
    assert wait_for_policy(sc, paths, PolicyNeed("rl", 1)) == (1, str(dirs.path(1)))
    protocol.announce_offer(paths.dir, "127.0.0.1", 1234, version=2, stage="rl", trainer_step=2, timeout_s=5,
                         bucket_bytes=1 << 20)
    assert wait_for_policy(sc, paths, PolicyNeed("rl", 1)) == (2, MEMORY)    # newer than the files
    assert wait_for_policy(sc, paths, PolicyNeed("rl", 2)) == (2, MEMORY)    # only in memory
    dirs.commit(2, dirs.begin(2), stage="rl", trainer_step=2)
    assert wait_for_policy(sc, paths, PolicyNeed("rl", 2)) == (2, MEMORY)    # the same version: memory, the faster
    dirs.commit(3, dirs.begin(3), stage="rl", trainer_step=3)
    assert wait_for_policy(sc, paths, PolicyNeed("rl", 2)) == (3, str(dirs.path(3)))   # files newer
    record_offered(paths.dir, 7, "rl", 6)
    assert next_version(paths) == 8   # run-global: past what was offered in memory, not only the files


def test_publish_cadence_and_config_check():
    from types import SimpleNamespace

    from rstar_hpc.config.trainer import TrainerConfig
    from rstar_hpc.trainer.weight_sender import makes_version, publishes_files

    rl = SimpleNamespace(kind="rl", num_steps=7, name="rl")
    sft = SimpleNamespace(kind="sft", num_steps=7, name="sft")
    mem = TrainerConfig(weight_sync="memory", publish_every=3)
    assert [s for s in range(1, 8) if publishes_files(mem, rl, s)] == [3, 6, 7]   # the stage's last step too
    assert all(makes_version(mem, rl, s) for s in range(1, 8))                     # every step offered in memory
    assert [s for s in range(1, 8) if publishes_files(mem, sft, s)] == [7]
    assert all(publishes_files(TrainerConfig(), rl, s) for s in range(1, 8))
    with pytest.raises(ValueError, match="trainer.publish_every=3 with trainer.weight_sync=files.*set publish_every: 1"):
        TrainerConfig(publish_every=3)


def test_status_line_names_fallbacks(tmp_path):
    protocol.write_engine_weights(tmp_path, "rl", 4, {1: {"via": "memory", "version": 9, "seconds": 0.5},
                                                   2: {"via": "files", "version": 8, "seconds": 2.0,
                                                       "reason": "DistStoreError: timed out"}})
    text = protocol.describe_engine_weights(protocol.read_engine_weights(tmp_path))
    assert text == ("weights of step 4 (rl): engine 1: v9 via memory (0.50s); engine 2: v8 via files (2.00s), "
                    "fell back: DistStoreError: timed out")


def _scheduler(paths, step: int = 3, need=None, versions=None):
    """Rank 0's side of a step's weights (no MPI: it only reads the offer and talks to the store)."""
    from rstar_hpc.pipeline import PolicyNeed
    from rstar_hpc.rollout.policy_source import StepWeights

    return StepWeights(paths, "rl", step, need or PolicyNeed("rl", 2), engine_versions=versions)


def test_no_reachable_offer_falls_back_to_files_at_once(tmp_path):
    """No offer, or an offer whose trainer process is gone: the newest files, with why, without asking anyone;
    a store nobody serves: after the connect timeout, not the session's (900 s here)."""
    import os
    import subprocess
    import sys

    paths = RunPaths(tmp_path / "run")
    paths.create()
    dirs = paths.policies()
    dirs.commit(3, dirs.begin(3), stage="rl", trainer_step=2)
    sched = _scheduler(paths)
    start = sched.memory_session([1, 2], 4)
    assert (start["policy_version"], start["fallback_version"], start["policy_dir"]) == (3, 3, str(dirs.path(3)))
    assert "withdrew its in-memory offer" in start["memory_failed"] and "policy_memory" not in start

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    protocol.announce_offer(paths.dir, "127.0.0.1", 1, version=4, stage="rl", trainer_step=3, timeout_s=900,
                         bucket_bytes=1 << 20)
    record = protocol.read_offer(paths.dir)
    record["pid"] = int(dead.stdout)
    path = protocol.rendezvous.announcement_path(paths.dir, protocol.ROLE, protocol.NAME)
    with open(path, "w") as f:
        f.write(json.dumps(record))
    start = _scheduler(paths).memory_session([1, 2], 4)
    assert start["policy_version"] == 3 and f"pid {int(dead.stdout)}) is gone" in start["memory_failed"]

    record["pid"] = os.getpid()   # alive, but nothing listens on the port: a connection error
    with open(path, "w") as f:
        f.write(json.dumps(record))
    from rstar_hpc.rollout import weight_receiver
    with pytest.raises(Exception) as err:
        weight_receiver.open_session(record, 4, receivers=1, connect_timeout_s=1)
    assert not isinstance(err.value, weight_receiver.SessionRefused)

    empty = RunPaths(tmp_path / "empty")   # a version only in memory, nothing published: nothing to fall back to
    empty.create()
    with pytest.raises(RuntimeError, match="no published version to fall back to"):
        _scheduler(empty).memory_session([1], 4)


def test_sessions_leave_out_engines_holding_the_version_and_follow_the_offer(tmp_path):
    """Rank 0 knows each engine's version from its HELLOs: only the others join; all hold it, and no session opens.
    The trainer moved on to a newer version that still satisfies the step: that one is synced."""
    from rstar_hpc.pipeline import PolicyNeed
    from rstar_hpc.rollout.weight_receiver import abort_session
    from rstar_hpc.trainer.weight_sender import WeightServer

    paths = RunPaths(tmp_path / "run")
    paths.create()
    server = WeightServer(paths.dir, timeout_s=30, bucket_bytes=2048, host="127.0.0.1")
    try:
        server.offer(4, "rl", 3, _state(0))
        start = _scheduler(paths, versions={1: 4, 2: 3}).memory_session([1, 2], 4)
        session = start["policy_memory"]
        assert session["first_ranks"] == {2: 1} and session["size"] == 2 and start["policy_version"] == 4
        abort_session(session, "nobody here joins")   # else the server waits for the member until its timeout
        start = _scheduler(paths, versions={1: 4, 2: 4}).memory_session([1, 2], 4)
        assert start["policy_memory"]["first_ranks"] == {} and "host" not in start["policy_memory"]

        server.offer(5, "rl", 4, _state(1))   # after rank 0 picked v4 for the step, before it asked
        sched = _scheduler(paths, need=PolicyNeed("rl", 3))
        start = sched.memory_session([1, 2], 4)
        abort_session(start["policy_memory"], "nobody here joins")
        assert start["policy_version"] == 5 and start["policy_memory"]["version"] == 5
        assert start["policy_memory"]["first_ranks"] == {1: 1, 2: 2}
        assert server.sessions[-1]["refused"].startswith("the trainer holds v5 now")
    finally:
        server.close()


def test_a_member_that_cannot_join_aborts_the_session_for_everyone(tmp_path):
    """Engine 2 cannot join and says so: engine 1 and the trainer give up at once with its reason (the session's
    timeout is 900 s: waiting for the missing member would outlast the test)."""
    from rstar_hpc.rollout.weight_receiver import abort_session, open_session, receive_buckets
    from rstar_hpc.trainer.weight_sender import WeightServer

    server = WeightServer(tmp_path, timeout_s=900, bucket_bytes=2048, host="127.0.0.1")
    try:
        server.offer(4, "rl", 3, _state(0))
        session = open_session(protocol.read_offer(tmp_path), 4, receivers=2)
        failed: list[BaseException] = []

        def receive() -> None:
            try:
                list(receive_buckets(session, 1, {}))
            except BaseException as e:  # noqa: BLE001
                failed.append(e)
        t = threading.Thread(target=receive)
        t.start()
        assert abort_session(session, "engine rank 2 could not join: RuntimeError: no route")
        t.join(120)
        assert not t.is_alive() and isinstance(failed[0], protocol.SessionAborted) and "no route" in str(failed[0])
        for _ in range(600):
            if server.sessions:
                break
            threading.Event().wait(0.1)
        assert server.sessions[-1] == {"session": 0, "version": 4,
                                       "aborted": "session aborted: engine rank 2 could not join: RuntimeError: "
                                                  "no route"}
    finally:
        server.close()


def test_engine_rank_outside_the_session_keeps_its_version_or_takes_the_files():
    """An engine rank rank 0 left out of the session (it holds the version) keeps it without joining; one left out
    by mistake (another version) loads the newest published files and says why; a member that fails aborts."""
    import asyncio

    from rstar_hpc.rollout.engine_rank import _load_weights

    class Engine:   # records what the rank asked of its engine
        def __init__(self, version):
            self.policy_version, self.calls = version, []

        async def sync_policy(self, session, first_rank):
            self.calls.append(("sync", first_rank))
            raise RuntimeError("cannot reach the trainer")

        async def load_policy(self, policy_dir, version):
            self.calls.append(("files", policy_dir, version))
            self.policy_version = version
            return 0.1

    import datetime

    store = torch.distributed.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30),
                                       wait_for_workers=False)   # the trainer's, where the failed member aborts
    start = {"stage": "rl", "step": 3, "policy_version": 5, "policy_dir": "/run/policy/v-4", "fallback_version": 4,
             "policy_memory": {"version": 5, "first_ranks": {2: 1}, "host": "127.0.0.1", "port": store.port,
                               "session": 0, "size": 2, "timeout_s": 30}}
    holder = Engine(5)
    assert asyncio.run(_load_weights(holder, start, 1)) == {"via": "kept", "version": 5} and not holder.calls
    stale = Engine(3)
    got = asyncio.run(_load_weights(stale, start, 1))
    assert got["via"] == "files" and got["version"] == 4 and "not in the sync session of v5" in got["reason"]
    member = Engine(3)
    got = asyncio.run(_load_weights(member, start, 2))
    assert member.calls == [("sync", 1), ("files", "/run/policy/v-4", 4)]
    assert got["via"] == "files" and "cannot reach the trainer" in got["reason"]
    assert store.get(protocol.session_prefix(0) + protocol.ABORT).decode() == \
        "engine rank 2 could not join: RuntimeError: cannot reach the trainer"
