"""In-memory weight sync without vLLM: the bucket layout, a real session over gloo between the trainer's
WeightServer and a receiver (both here, each with its own group member), the refusal of a stale version, the
rollout's choice between an in-memory offer and published files, the file-publish cadence and its config check,
and the status line."""
from __future__ import annotations

import threading

import pytest
import torch

from rstar_hpc.exchange import weight_sync as proto
from rstar_hpc.exchange.rundir import RunPaths


def test_buckets_keep_order_alignment_and_size():
    specs = [("a", (3,), "float32"), ("b", (5, 2), "bfloat16"), ("big", (100,), "float32"), ("c", (1,), "int64")]
    plan = proto.plan_buckets(specs, bucket_bytes=64)
    assert [[e.name for e in b] for b in plan] == [["a", "b"], ["big"], ["c"]]   # big alone: larger than a bucket
    a, b = plan[0]
    assert (a.offset, a.nbytes, b.offset, b.nbytes) == (0, 12, 16, 20)          # 8-byte aligned
    assert proto.bucket_nbytes(plan[0]) == 36 and proto.layout_from_json(proto.layout_to_json(plan)) == plan
    with pytest.raises(ValueError, match="dtype 'complex64' cannot be synced"):
        proto.plan_buckets([("z", (1,), "complex64")], 64)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(50, 16, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g).to(torch.bfloat16),
            "model.norm.weight": torch.randn(16, generator=g)}


def test_session_sends_every_tensor_bitwise_and_refuses_a_stale_version(tmp_path):
    from rstar_hpc.rollout.weight_sync import SessionRefused, open_session, receive_buckets
    from rstar_hpc.trainer.weight_sync import WeightServer

    server = WeightServer(tmp_path, timeout_s=30, bucket_bytes=2048, host="127.0.0.1")
    try:
        state = _state(0)
        server.offer(4, "rl", 3, state)
        offer = proto.read_offer(tmp_path)
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
        assert len(proto.layout_from_json(server.store.get(proto.session_prefix(0) + "layout"))) > 1  # buckets

        server.offer(5, "rl", 4, _state(1))   # the trainer moved on: a request for v4 is refused, with why
        with pytest.raises(SessionRefused, match="holds v5 now, not v4"):
            open_session(offer, 4, receivers=1)
    finally:
        server.close()
    assert proto.read_offer(tmp_path) is None and proto.newest_offered_version(tmp_path) == 5


def test_rollout_picks_the_newer_of_offer_and_files(tmp_path):
    from rstar_hpc.config.rollout import SchedulerConfig
    from rstar_hpc.pipeline import PolicyNeed
    from rstar_hpc.rollout.step import MEMORY, wait_for_policy

    paths = RunPaths(tmp_path / "run")
    paths.create()
    dirs = paths.policies()
    dirs.commit(1, dirs.begin(1), stage="rl", trainer_step=1)
    sc = SchedulerConfig()
    assert wait_for_policy(sc, paths, PolicyNeed("rl", 1)) == (1, str(dirs.path(1)))
    proto.announce_offer(paths.dir, "127.0.0.1", 1234, version=2, stage="rl", trainer_step=2, timeout_s=5,
                         bucket_bytes=1 << 20)
    assert wait_for_policy(sc, paths, PolicyNeed("rl", 1)) == (2, MEMORY)    # newer than the files
    assert wait_for_policy(sc, paths, PolicyNeed("rl", 2)) == (2, MEMORY)    # only in memory
    dirs.commit(3, dirs.begin(3), stage="rl", trainer_step=3)
    assert wait_for_policy(sc, paths, PolicyNeed("rl", 2)) == (3, str(dirs.path(3)))   # files newer
    from rstar_hpc.trainer.weight_sync import next_version
    proto.record_offered(paths.dir, 7, "rl", 6)
    assert next_version(paths) == 8   # run-global: past what was offered in memory, not only the files


def test_publish_cadence_and_config_check():
    from types import SimpleNamespace

    from rstar_hpc.config.trainer import TrainerConfig
    from rstar_hpc.trainer.weight_sync import makes_version, publishes_files

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
    proto.write_engine_weights(tmp_path, "rl", 4, {1: {"via": "memory", "version": 9, "seconds": 0.5},
                                                   2: {"via": "files", "version": 8, "seconds": 2.0,
                                                       "reason": "DistStoreError: timed out"}})
    text = proto.describe_engine_weights(proto.read_engine_weights(tmp_path))
    assert text == ("weights of step 4 (rl): engine 1: v9 via memory (0.50s); engine 2: v8 via files (2.00s), "
                    "fell back: DistStoreError: timed out")
