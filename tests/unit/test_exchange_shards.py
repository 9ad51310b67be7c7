import os
import subprocess
import sys
import time

import pytest

from rstar_hpc.exchange.columns import from_table, token_view
from rstar_hpc.exchange.errors import CorruptShardError, ExchangeError, StepNotReadyError
from rstar_hpc.exchange.reader import StepReader
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.synthetic.trajectories import make_step
from rstar_hpc.exchange.writer import ShardWriter


@pytest.fixture
def paths(tmp_path):
    p = RunPaths(tmp_path / "run")
    p.create()
    return p


def _write(paths, step, producer, rank, n=6, max_rows=4):
    trajs = make_step("run", "rl", step, num_prompts=n // 2, samples_per_prompt=2, mean_tokens=120, engine_rank=rank)
    w = ShardWriter(paths, "rl", step, producer, max_rows_per_shard=max_rows)
    w.write(trajs)
    return w, trajs


def test_nothing_visible_before_commit(paths):
    w, trajs = _write(paths, 0, "rollout-0", 0)   # 6 rows at 4 per shard: one shard already published
    folder = paths.traj_step_dir("rl", 0)
    assert any(n.endswith(".arrows") for n in os.listdir(folder))
    reader = StepReader(paths, "rl")
    assert reader.commits(0) == {}
    assert reader.read(0).num_rows == 0
    record = w.commit()
    assert record["rows"] == 6 and len(record["shards"]) == 2
    table = reader.read(0)
    assert [t.key for t in from_table(table)] == [t.key for t in trajs]
    values, offsets = token_view(table, "response_ids")
    assert len(offsets) == 7 and offsets[-1] == values.size


def test_wait_names_missing_producers(paths):
    _write(paths, 1, "rollout-0", 0)[0].commit()
    reader = StepReader(paths, "rl")
    with pytest.raises(StepNotReadyError) as err:
        reader.wait(1, ["rollout-0", "rollout-1", "rollout-2"], timeout_s=0.3, poll_s=0.05)
    assert err.value.missing == ["rollout-1", "rollout-2"] and err.value.committed == ["rollout-0"]
    assert "rollout-1" in str(err.value) and "step-00000001" in str(err.value)
    assert list(reader.wait(1, ["rollout-0"], timeout_s=0)) == ["rollout-0"]


def test_commit_is_once_and_leftovers_are_cleaned(paths):
    w, _ = _write(paths, 2, "rollout-0", 0)
    crashed = [n for n in os.listdir(paths.traj_step_dir("rl", 2))]   # an attempt that died before commit
    assert crashed
    w2, _ = _write(paths, 2, "rollout-0", 0, max_rows=100)
    assert not set(crashed) & set(os.listdir(paths.traj_step_dir("rl", 2)))
    w2.commit()
    assert ShardWriter.is_committed(paths, "rl", 2, "rollout-0")
    with pytest.raises(ExchangeError, match="already committed step 2"):
        ShardWriter(paths, "rl", 2, "rollout-0")
    # a producer whose name extends another's is not mistaken for its leftovers
    _write(paths, 2, "rollout-00", 1)[0].commit()
    assert StepReader(paths, "rl").read(2).num_rows == 12


def test_abort_on_exception_leaves_nothing(paths):
    with pytest.raises(RuntimeError):
        with ShardWriter(paths, "rl", 3, "rollout-0", max_rows_per_shard=2) as w:
            w.write(make_step("run", "rl", 3, 3, 2, mean_tokens=50))
            raise RuntimeError("engine died")
    assert os.listdir(paths.traj_step_dir("rl", 3)) == []


def test_rejects_rows_of_another_step(paths):
    w = ShardWriter(paths, "rl", 4, "rollout-0")
    with pytest.raises(ValueError, match="step 5, this writer for stage 'rl' step 4"):
        w.write(make_step("run", "rl", 5, 1, 1, mean_tokens=20))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_shard_detected_with_path(paths, damage):
    record = _write(paths, 5, "rollout-0", 0)[0].commit()
    shard = paths.traj_step_dir("rl", 5) / record["shards"][1]["file"]
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
    else:
        shard.unlink()
    with pytest.raises(CorruptShardError) as err:
        StepReader(paths, "rl").read(5)
    assert err.value.path == str(shard) and str(shard) in str(err.value)


def test_torn_commit_record_is_reported(paths):
    _write(paths, 6, "rollout-0", 0)[0].commit()
    path = paths.traj_commit("rl", 6, "rollout-0")
    path.write_text(path.read_text()[:40])
    with pytest.raises(ExchangeError, match="rollout-0.commit.json: unreadable commit record"):
        StepReader(paths, "rl").commits(6)


WRITER = """
import sys, time
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.synthetic.trajectories import make_step
from rstar_hpc.exchange.writer import ShardWriter
run, step, rank, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
paths = RunPaths(run)
trajs = make_step("run", "rl", step, num_prompts=n, samples_per_prompt=2, mean_tokens=400, engine_rank=rank)
w = ShardWriter(paths, "rl", step, f"rollout-{rank}", max_rows_per_shard=3)
for i in range(0, len(trajs), 2):
    w.write(trajs[i:i + 2])
    time.sleep(0.01 * (rank + 1))
w.commit()
"""


def test_concurrent_writers_and_a_reader(paths):
    producers = [f"rollout-{r}" for r in range(4)]
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(paths.dir), "7", str(r), "10"]) for r in range(4)]
    reader = StepReader(paths, "rl")
    seen_counts = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        records = reader.commits(7)
        table = reader.read(7, records=records)   # whatever is committed is whole: 20 rows per producer
        assert table.num_rows == 20 * len(records)
        seen_counts.add(len(records))
        if len(records) == 4:
            break
        time.sleep(0.02)
    assert [p.wait(60) for p in procs] == [0] * 4
    reader.wait(7, producers, timeout_s=5)
    trajs = from_table(reader.read(7, producers))
    assert len({t.key for t in trajs}) == 80 and {t.engine_rank for t in trajs} == {0, 1, 2, 3}
    assert 4 in seen_counts
