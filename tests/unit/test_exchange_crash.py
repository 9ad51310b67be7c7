"""SIGKILL at random points: readers never accept partial data; restarts consume every row exactly once."""
import json
import random
import signal
import subprocess
import sys
import time

import pytest

from rstar_hpc.exchange.columns import from_table
from rstar_hpc.exchange.reader import Consumer, StepReader
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.writer import ShardWriter

PRODUCER = """
import sys, time
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.synthetic.trajectories import make_step
from rstar_hpc.exchange.writer import ShardWriter
run, rank, num_steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
first = int(sys.argv[4]) if len(sys.argv) > 4 else 0
paths = RunPaths(run)
for step in range(first, first + num_steps):
    if ShardWriter.is_committed(paths, "rl", step, f"rollout-{rank}"):
        continue                       # resume: committed steps are never written twice
    trajs = make_step("run", "rl", step, num_prompts=8, samples_per_prompt=2, mean_tokens=600, engine_rank=rank)
    w = ShardWriter(paths, "rl", step, f"rollout-{rank}", max_rows_per_shard=2)
    for i in range(0, len(trajs), 2):
        w.write(trajs[i:i + 2])
        time.sleep(0.01)               # a writer's pace, not a tight loop: kills land mid-step, not after the job
    w.commit()
"""

CONSUMER = """
import sys, time
from rstar_hpc.exchange.reader import Consumer
from rstar_hpc.exchange.rundir import RunPaths
run, num_steps, producers = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
c = Consumer(RunPaths(run), "rl", "trainer", producers)
while c.next_step < num_steps:
    batch = c.wait(timeout_s=60, poll_s=0.02)
    seen = dict(c.state or {})
    for t in batch.trajectories():     # the step's effect, committed together with the cursor
        k = f"{t.prompt_uid}#{t.sample_index}"
        seen[k] = seen.get(k, 0) + 1
    time.sleep(0.25)                   # widen the window between reading and acking
    c.ack(batch.step, state=seen)
"""


def _spawn(code, *args):
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)])


def _kill_at_random(proc, rng, max_s):
    try:
        proc.wait(rng.uniform(0.3, max_s))   # ~0.3 s is interpreter + pyarrow start-up
        return False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return True


def _assert_only_whole_commits(paths, step, expected_rows):
    reader = StepReader(paths, "rl")
    for producer, record in reader.commits(step).items():
        table = reader.read(step, [producer])       # verifies sizes and sha256 of every listed shard
        assert table.num_rows == record["rows"] == expected_rows, (producer, step)


def _producer_seconds(folder) -> float:
    """How long one producer run of 10 steps takes on this machine, to draw kill points within it (a fixed
    window misses the writer once start-up gets faster: the writer no longer imports the config via the algo)."""
    paths = RunPaths(folder)
    paths.create()
    t0 = time.monotonic()
    assert _spawn(PRODUCER, paths.dir, 0, 10, 0).wait(120) == 0
    return time.monotonic() - t0


@pytest.mark.slow
def test_sigkilled_writer_never_leaves_accepted_partial_data(tmp_path):
    rng = random.Random(1234)
    paths = RunPaths(tmp_path / "run")
    paths.create()
    reader = StepReader(paths, "rl")
    max_s = max(0.4, _producer_seconds(tmp_path / "timing"))
    interrupted = 0
    for attempt in range(8):
        steps = range(10 * attempt, 10 * attempt + 10)
        killed = _kill_at_random(_spawn(PRODUCER, paths.dir, 0, 10, steps[0]), rng, max_s)
        for step in steps:
            _assert_only_whole_commits(paths, step, 16)
        interrupted += killed and len([s for s in steps if reader.commits(s)]) < 10
        assert _spawn(PRODUCER, paths.dir, 0, 10, steps[0]).wait(120) == 0   # the restart finishes the job
        for step in steps:
            keys = [t.key for t in from_table(reader.read(step, ["rollout-0"]))]
            assert len(keys) == len(set(keys)) == 16
    assert interrupted >= 2, "the random kill points never hit a writer mid-step; the test proved nothing"


@pytest.mark.slow
def test_kill_producers_and_consumer_every_row_consumed_exactly_once(tmp_path):
    rng = random.Random(99)
    paths = RunPaths(tmp_path / "run")
    paths.create()
    num_steps, ranks = 4, [0, 1]
    producers = ",".join(f"rollout-{r}" for r in ranks)
    consumer_kills = 0
    for _ in range(40):
        cursor = paths.cursor("rl", "trainer")
        if cursor.exists() and json.loads(cursor.read_text())["next_step"] == num_steps:
            break
        procs = [_spawn(PRODUCER, paths.dir, r, num_steps) for r in ranks]
        consumer = _spawn(CONSUMER, paths.dir, num_steps, producers)
        consumer_kills += _kill_at_random(consumer, rng, 1.5)
        for p in procs:
            _kill_at_random(p, rng, 1.0)
    consumer = _spawn(CONSUMER, paths.dir, num_steps, producers)
    assert consumer.wait(120) == 0
    final = Consumer(paths, "rl", "trainer", producers.split(","))
    assert final.next_step == num_steps
    assert consumer_kills >= 2, "the consumer was never killed mid-run; the test proved nothing"
    seen = final.state
    expected = {f"p{s}-{r}-{p}#{i}" for s in range(num_steps) for r in ranks for p in range(8) for i in range(2)}
    assert set(seen) == expected                   # no loss
    assert set(seen.values()) == {1}               # no duplicate


def test_shards_without_commit_record_are_invisible(tmp_path):
    # the state a SIGKILL between the last shard's rename and the commit record leaves behind
    # (max_rows_per_shard=1: each write publishes its shard at once)
    paths = RunPaths(tmp_path / "run")
    from rstar_hpc.synthetic.trajectories import make_step
    w = ShardWriter(paths, "rl", 0, "rollout-0", max_rows_per_shard=1)
    w.write(make_step("run", "rl", 0, 2, 1, mean_tokens=30))
    assert len([n for n in paths.traj_step_dir("rl", 0).iterdir() if n.suffix == ".arrows"]) == 2
    reader = StepReader(paths, "rl")
    assert reader.commits(0) == {} and reader.read(0).num_rows == 0
    c = Consumer(paths, "rl", "trainer", ["rollout-0"])
    with pytest.raises(TimeoutError, match=r"missing producers \['rollout-0'\]"):
        c.wait(timeout_s=0.1, poll_s=0.02)
