"""The trainer's TrajectorySource meets a committed step whose shard was corrupted on disk (a real bit flip): it takes
the commit back instead of failing, waits, and trains the step the rollout writes again, once. A step it already
consumed is left alone; with partial rollouts (a step not regenerable alone) it stops with the reason."""
from __future__ import annotations

import pytest
from tests.helpers.trainer import rl_step_trajs

from rstar_hpc.config import load_config
from rstar_hpc.exchange.errors import ExchangeError
from rstar_hpc.exchange.quarantine import quarantined
from rstar_hpc.exchange.reader import StepReader
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.writer import ShardWriter
from rstar_hpc.trainer.rl import TrajectorySource

STAGE = "rl"


def _write(paths, step, seed=0):
    trajs = rl_step_trajs(step, seed=seed)
    with ShardWriter(paths, STAGE, step, "rollout") as w:
        w.write(trajs)
    return trajs


def _flip_a_bit(paths, step) -> str:
    record = StepReader(paths, STAGE).commits(step)["rollout"]
    shard = paths.traj_step_dir(STAGE, step) / record["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return str(shard)


def test_a_corrupt_step_is_regenerated_for_the_trainer_and_trained_once(dist1, tmp_path):
    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}"])
    paths = RunPaths(cfg.run.dir)
    for step in (0, 1):
        _write(paths, step)
    source = TrajectorySource(paths, STAGE, cfg.algo, cfg.trainer, run_seed=cfg.run.seed)
    assert source.next().step == 0
    source.commit("step-00000001")             # step 0 trained and acked
    _flip_a_bit(paths, 0)                      # consumed: nothing to do, nobody reads it again
    shard = _flip_a_bit(paths, 1)              # not consumed yet: the trainer's next read finds it

    rewrites = []

    def rollout_writes_it_again() -> bool:     # the rollout's stage walk, seen from the trainer's wait loop
        if not ShardWriter.is_committed(paths, STAGE, 1, "rollout"):
            rewrites.append(_write(paths, 1, seed=7))
        return False

    batch = source.next(stop_requested=rollout_writes_it_again, poll_s=0.0)
    assert batch.step == 1 and len(rewrites) == 1
    assert batch.metrics["roc/num_trajectories"] == len(rewrites[0]) == 16   # the new rows, once
    reasons = quarantined(paths, STAGE, 1)
    assert len(reasons) == 1 and shard in reasons[0]["reason"] and "sha256" in reasons[0]["reason"]
    assert quarantined(paths, STAGE, 0) == [] and ShardWriter.is_committed(paths, STAGE, 0, "rollout")
    assert source.next_step == 2
    source.commit("step-00000002")
    assert source.consumer.next_step == 2


def test_with_partial_rollouts_a_corrupt_step_stops_the_trainer(dist1, tmp_path):
    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}"])
    paths = RunPaths(cfg.run.dir)
    _write(paths, 0)
    shard = _flip_a_bit(paths, 0)
    source = TrajectorySource(paths, STAGE, cfg.algo, cfg.trainer, run_seed=cfg.run.seed, regenerate_corrupt=False)
    with pytest.raises(ExchangeError, match="partial_rollouts the step cannot be regenerated alone") as err:
        source.next()
    assert shard in str(err.value)
    assert ShardWriter.is_committed(paths, STAGE, 0, "rollout") and quarantined(paths, STAGE, 0) == []
