"""A committed shard corrupted on disk: its commit is taken back (quarantined with a reason), the step reads as
uncommitted, the rollout's stage walk writes it again with the same prompts, and readers see it once. A step a
consumer acked is never taken back. Real shards, a real bit flip."""
from __future__ import annotations

import json
import os

import pytest

from rstar_hpc import pipeline
from rstar_hpc.config import load_config
from rstar_hpc.exchange.columns import from_table
from rstar_hpc.exchange.errors import CorruptShardError, ExchangeError
from rstar_hpc.exchange.quarantine import MAX_QUARANTINES, quarantine_commit, quarantine_dir, quarantined
from rstar_hpc.exchange.reader import Consumer, StepReader
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.synthetic.trajectories import make_step
from rstar_hpc.exchange.writer import ShardWriter

STAGE, PRODUCER = "rl-short", pipeline.PRODUCER


@pytest.fixture
def paths(tmp_path):
    p = RunPaths(tmp_path / "run")
    p.create()
    return p


def _commit(paths, step, seed=0):
    trajs = make_step("run", STAGE, step, num_prompts=2, samples_per_prompt=2, mean_tokens=200, seed=seed)
    with ShardWriter(paths, STAGE, step, PRODUCER) as w:
        w.write(trajs)
    return trajs


def _flip_a_bit(paths, step) -> str:
    record = StepReader(paths, STAGE).commits(step)[PRODUCER]
    shard = paths.traj_step_dir(STAGE, step) / record["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x10
    shard.write_bytes(bytes(data))
    return str(shard)


def _corrupt_error(paths, step) -> CorruptShardError:
    with pytest.raises(CorruptShardError) as err:
        StepReader(paths, STAGE).read(step)
    return err.value


def test_a_corrupt_step_is_taken_back_then_written_again_and_read_once(paths):
    _commit(paths, 0)
    shard = _flip_a_bit(paths, 0)
    err = _corrupt_error(paths, 0)
    assert err.path == shard

    folder = quarantine_commit(paths, STAGE, 0, PRODUCER, str(err))
    assert folder == quarantine_dir(paths, STAGE, 0) / "rollout-0"
    reader = StepReader(paths, STAGE)
    assert reader.commits(0) == {} and not ShardWriter.is_committed(paths, STAGE, 0, PRODUCER)
    # the evidence is kept aside: record, shard, reason; nothing of it is left where readers and writers look
    assert sorted(os.listdir(folder)) == sorted([os.path.basename(shard), "reason.json", "rollout.commit.json"])
    assert os.listdir(paths.traj_step_dir(STAGE, 0)) == ["quarantine"]
    reason = quarantined(paths, STAGE, 0)
    assert len(reason) == 1 and shard in reason[0]["reason"] and reason[0]["commit"]["rows"] == 4

    again = _commit(paths, 0, seed=1)   # the producer's stage walk writes the step anew
    assert list(reader.commits(0)) == [PRODUCER]
    assert [t.key for t in from_table(reader.read(0))] == [t.key for t in again]   # once, not twice
    assert len(quarantined(paths, STAGE, 0)) == 1


def test_a_step_a_consumer_acked_is_never_taken_back(paths):
    _commit(paths, 0)
    consumer = Consumer(paths, STAGE, "trainer", [PRODUCER])
    consumer.wait(timeout_s=0)
    consumer.ack(0, state={"checkpoint": "step-00000001"})
    _flip_a_bit(paths, 0)
    with pytest.raises(ExchangeError, match=r"acked it already .*must not be regenerated"):
        quarantine_commit(paths, STAGE, 0, PRODUCER, "bit flip")
    assert ShardWriter.is_committed(paths, STAGE, 0, PRODUCER) and quarantined(paths, STAGE, 0) == []


def test_a_step_corrupt_again_and_again_stops_the_run(paths):
    _commit(paths, 0)
    for k in range(MAX_QUARANTINES):
        _flip_a_bit(paths, 0)
        quarantine_commit(paths, STAGE, 0, PRODUCER, str(_corrupt_error(paths, 0)))
        _commit(paths, 0, seed=k + 1)
    _flip_a_bit(paths, 0)
    with pytest.raises(ExchangeError, match=f"regenerated {MAX_QUARANTINES} times already .*check the file system"):
        quarantine_commit(paths, STAGE, 0, PRODUCER, "bit flip")
    assert ShardWriter.is_committed(paths, STAGE, 0, PRODUCER)
    assert [json.loads((quarantine_dir(paths, STAGE, 0) / f"rollout-{k}" / "reason.json").read_text())["step"]
            for k in range(MAX_QUARANTINES)] == [0] * MAX_QUARANTINES


def test_the_stage_walk_goes_back_to_a_taken_back_step(paths):
    walk = pipeline.uncommitted_steps(paths, STAGE, 4)
    assert next(walk) == 0
    for step in (0, 1, 2):
        _commit(paths, step)
    assert next(walk) == 3
    _flip_a_bit(paths, 1)
    quarantine_commit(paths, STAGE, 1, PRODUCER, str(_corrupt_error(paths, 1)))
    _commit(paths, 3)
    assert next(walk) == 1           # before going on, the walk writes the taken-back step again
    _commit(paths, 1, seed=1)
    assert next(walk, None) is None  # all committed: the stage's walk is over

    walk = pipeline.uncommitted_steps(paths, STAGE, 5)
    assert next(walk) == 4
    with pytest.raises(RuntimeError, match="step 4 of stage 'rl-short' is still not committed after it ran"):
        next(walk)                   # a step that ran but did not commit is an error, not an endless loop


def test_a_step_waiting_for_a_policy_trained_on_a_taken_back_step_gives_way(paths, tmp_path):
    from rstar_hpc.config.rollout import SchedulerConfig
    from rstar_hpc.config.stages import StageLimits
    from rstar_hpc.rollout.policy_source import StepGivesWay
    from rstar_hpc.rollout.scheduler import StepScheduler
    from rstar_hpc.rollout.step import StepHooks, StepSpec, WorkItem

    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}"])
    for step in (0, 1):
        _commit(paths, step)
    need = pipeline.policy_need(cfg, STAGE, 2)   # on-policy: trained on steps 0 and 1
    assert need == pipeline.PolicyNeed(STAGE, 2) and pipeline.taken_back(cfg, paths, need) == []
    assert pipeline.taken_back(cfg, paths, pipeline.PolicyNeed("sft", 20)) == []   # an sft stage has no steps
    _flip_a_bit(paths, 1)
    quarantine_commit(paths, STAGE, 1, PRODUCER, str(_corrupt_error(paths, 1)))
    assert pipeline.taken_back(cfg, paths, need) == [1]

    class Comm:
        def Get_size(self):
            return 2

    items = [WorkItem("p", 0, [1] * 10, "p", "1")]
    step = StepScheduler(Comm(), None, SchedulerConfig(), paths, StepSpec(STAGE, 2, items, StageLimits(100, 4), need),
                         score=None, hooks=StepHooks(taken_back=lambda: pipeline.taken_back(cfg, paths, need)))
    with pytest.raises(StepGivesWay, match=r"step 2 of stage rl-short waits for .* steps \[1\]"):
        step.run()
    assert not ShardWriter.is_committed(paths, STAGE, 2, PRODUCER)


def test_run_status_names_a_taken_back_step_until_it_is_written_again(paths):
    from rstar_hpc.launch.status import taken_back

    cfg = load_config("tiny-cpu", [f"run.root={paths.dir.parent}", f"run.name={paths.dir.name}"])
    _commit(paths, 1)
    quarantine_commit(paths, STAGE, 1, PRODUCER, str(_corrupt_error(paths, 1)) if _flip_a_bit(paths, 1) else "")
    [waiting] = taken_back(cfg, paths)
    assert (waiting["stage"], waiting["step"], waiting["times"], waiting["written_again"]) == (STAGE, 1, 1, False)
    assert "taken back 1x as corrupt" in waiting["text"] and "waiting for the rollout" in waiting["text"]
    _commit(paths, 1, seed=1)
    assert taken_back(cfg, paths)[0]["written_again"] is True
