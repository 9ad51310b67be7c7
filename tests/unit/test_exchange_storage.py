"""Shared storage that fills up: every exchange write fails with StorageError naming the path and the free space,
leaves nothing a reader would take, and succeeds once space is freed. A real tmpfs and a real ENOSPC (storage_fault)."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading

import pytest
from tests.helpers.storage_fault import fill, small_fs

from rstar_hpc.exchange.atomic import atomic_write_json, tmp_name
from rstar_hpc.exchange.checkpoints import CommittedDirs
from rstar_hpc.exchange.columns import from_table
from rstar_hpc.exchange.errors import StorageError, is_storage_failure
from rstar_hpc.exchange.reader import Consumer, StepReader
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.synthetic.trajectories import make_step
from rstar_hpc.exchange.writer import ShardWriter


@pytest.fixture
def fs(tmp_path):
    with small_fs(tmp_path / "fs", "4m") as mnt:
        yield mnt


@pytest.fixture
def paths(fs):
    p = RunPaths(fs / "run")
    p.create()
    return p


def _files(folder) -> list[str]:
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def _says_where(err: StorageError, path) -> None:
    msg = str(err)
    assert err.errno == errno.ENOSPC and err.path == str(path) and str(path) in msg
    # the free space when the write failed (before the cleanup gave some back): what explains the failure
    assert err.free_bytes is not None and err.free_bytes < 64 * 1024 and "free of 4.0 MiB" in msg, msg
    assert "Free space" in msg and "No space left on device" in msg


def test_full_disk_while_writing_shards_leaves_nothing_and_retry_commits_once(fs, paths):
    trajs = make_step("run", "rl", 0, num_prompts=8, samples_per_prompt=2, mean_tokens=3000)
    ballast = fill(fs, leave=200 * 1024)   # less than the step's ~600 KiB of shards
    with pytest.raises(StorageError) as err:
        with ShardWriter(paths, "rl", 0, "rollout", max_rows_per_shard=4) as w:
            w.write(trajs)
    _says_where(err.value, paths.traj_step_dir("rl", 0) / os.path.basename(err.value.path))
    assert "trajectory shard" in str(err.value) and err.value.path.endswith(".arrows")
    # nothing of the attempt is left: no shard, no tmp file, no commit record (its space is free again)
    assert _files(paths.traj_step_dir("rl", 0)) == []
    reader = StepReader(paths, "rl")
    assert reader.commits(0) == {} and not ShardWriter.is_committed(paths, "rl", 0, "rollout")

    ballast.unlink()   # the operator frees space; the restarted producer writes the step again
    with ShardWriter(paths, "rl", 0, "rollout", max_rows_per_shard=4) as w:
        w.write(trajs)
    assert list(reader.commits(0)) == ["rollout"]
    assert [t.key for t in from_table(reader.read(0))] == [t.key for t in trajs]   # each row once


PRODUCER = """
import sys
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.synthetic.trajectories import make_step
from rstar_hpc.exchange.writer import ShardWriter
paths = RunPaths(sys.argv[1])
if not ShardWriter.is_committed(paths, "rl", 0, "rollout"):   # a restarted producer skips committed steps
    with ShardWriter(paths, "rl", 0, "rollout") as w:
        w.write(make_step("run", "rl", 0, num_prompts=8, samples_per_prompt=2, mean_tokens=3000))
"""


def test_a_producer_process_stops_with_the_message_and_resumes_after_space_is_freed(fs, paths):
    ballast = fill(fs, leave=100 * 1024)
    run = [sys.executable, "-c", PRODUCER, str(paths.dir)]
    failed = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("rstar_hpc.exchange.errors.StorageError: cannot write trajectory shard " +
                           str(paths.traj_step_dir("rl", 0))), failed.stderr
    assert "No space left on device (ENOSPC)" in last and "free of 4.0 MiB" in last and "Free space" in last
    assert StepReader(paths, "rl").commits(0) == {} and _files(paths.traj_step_dir("rl", 0)) == []
    ballast.unlink()
    subprocess.run(run, check=True, timeout=120)
    subprocess.run(run, check=True, timeout=120)   # run again: nothing written twice
    assert list(StepReader(paths, "rl").commits(0)) == ["rollout"] and StepReader(paths, "rl").read(0).num_rows == 16


def test_full_disk_at_the_commit_record_leaves_the_step_uncommitted(fs, paths):
    trajs = make_step("run", "rl", 1, num_prompts=2, samples_per_prompt=2, mean_tokens=500)
    w = ShardWriter(paths, "rl", 1, "rollout", max_rows_per_shard=4)
    w.write(trajs)                     # 4 rows: the one shard is published already
    assert any(n.endswith(".arrows") for n in _files(paths.traj_step_dir("rl", 1)))
    ballast = fill(fs)
    with pytest.raises(StorageError) as err:
        w.commit()
    _says_where(err.value, paths.traj_commit("rl", 1, "rollout"))
    assert "trajectory commit record" in str(err.value)
    assert _files(paths.traj_step_dir("rl", 1)) == []   # the orphan shard went with it
    assert StepReader(paths, "rl").commits(1) == {}
    ballast.unlink()
    with ShardWriter(paths, "rl", 1, "rollout") as w:
        w.write(trajs)
    assert StepReader(paths, "rl").read(1).num_rows == 4
    assert [n for n in _files(paths.traj_step_dir("rl", 1)) if n.endswith(".commit.json")] == ["rollout.commit.json"]


def test_full_disk_keeps_the_old_file_and_the_consumer_cursor(fs, paths):
    path = fs / "run" / "record.json"
    atomic_write_json(path, {"v": 1})
    ballast = fill(fs)
    with pytest.raises(StorageError) as err:
        atomic_write_json(path, {"v": 2, "pad": "x" * 100_000}, what="test record")
    _says_where(err.value, path)
    assert "cannot write test record" in str(err.value)
    assert '"v": 1' in path.read_text() and ".tmp-" not in "".join(os.listdir(path.parent))

    # a consumer's ack that cannot be written leaves the cursor where it was: the step is delivered again
    with ShardWriter(paths, "rl", 0, "rollout") as w:
        ballast.unlink()
        w.write(make_step("run", "rl", 0, 1, 2, mean_tokens=50))
    consumer = Consumer(paths, "rl", "trainer", ["rollout"])
    consumer.wait(timeout_s=0)
    ballast = fill(fs)
    with pytest.raises(StorageError, match="consumer cursor"):
        consumer.ack(0, state={"checkpoint": "step-00000001"})
    assert Consumer(paths, "rl", "trainer", ["rollout"]).next_step == 0
    ballast.unlink()
    consumer.ack(0, state={"checkpoint": "step-00000001"})
    assert Consumer(paths, "rl", "trainer", ["rollout"]).next_step == 1


def test_full_disk_in_a_checkpoint_or_policy_never_moves_latest(fs):
    dirs = CommittedDirs(fs / "ckpt")
    tmp = dirs.begin(1)
    (tmp / "weights").write_bytes(b"a" * 1000)
    dirs.commit(1, tmp)
    ballast = fill(fs, leave=100 * 1024)
    tmp = dirs.begin(2)
    with pytest.raises(StorageError) as err:
        with dirs.guard(tmp, "checkpoint"):   # what the trainer's save does around its ranks' writes
            (tmp / "weights").write_bytes(b"b" * 1024 * 1024)
    _says_where(err.value, tmp)
    assert "cannot write checkpoint" in str(err.value)
    assert _files(dirs.root) == ["latest", "step-00000001"]   # the half-written directory is gone, hidden one too
    assert not any(n.startswith(".") for n in os.listdir(dirs.root))
    assert dirs.latest() == (1, dirs.path(1)) and dirs.complete_steps() == [1]

    # the marker itself does not fit: tmp discarded, latest unchanged
    tmp = dirs.begin(2)
    (tmp / "weights").write_bytes(b"b" * 4096)
    fill(fs / "ckpt")   # a second ballast takes what is left
    with pytest.raises(StorageError, match="COMMITTED.json"):
        dirs.commit(2, tmp)
    assert not tmp.exists() and dirs.latest() == (1, dirs.path(1)) and dirs.complete_steps() == [1]

    ballast.unlink()
    (fs / "ckpt" / "ballast").unlink()
    tmp = dirs.begin(2)
    (tmp / "weights").write_bytes(b"b" * 1024 * 1024)
    dirs.commit(2, tmp)
    assert dirs.latest() == (2, dirs.path(2)) and dirs.complete_steps() == [1, 2]


def test_storage_failures_are_found_behind_wrappers():
    eio = OSError(errno.EIO, "Input/output error")
    try:
        try:
            raise eio
        except OSError as e:
            raise RuntimeError("checkpoint writer thread failed") from e
    except RuntimeError as wrapped:
        assert is_storage_failure(wrapped) is eio

    class Wrapped:   # torch.distributed.checkpoint.api: CheckpointException(failures={rank: WrappedException})
        exception = eio

    class CheckpointException(BaseException):
        failures = {1: Wrapped()}
    assert is_storage_failure(CheckpointException()) is eio
    # carried as text only: megatron's checkpoint writer processes, safetensors' Rust writer
    found = is_storage_failure(RuntimeError("Worker failure: [Errno 28] No space left on device"))
    assert found.errno == errno.ENOSPC and found.strerror == "No space left on device"
    found = is_storage_failure(RuntimeError("Error while serializing: I/O error: Input/output error (os error 5)"))
    assert found.errno == errno.EIO
    # torch.save's zip writer drops the errno of a short write (seen from megatron's writer on a full tmpfs)
    found = is_storage_failure(RuntimeError(
        "Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"))
    assert found.errno == errno.ENOSPC and "wrote short" in found.strerror
    assert is_storage_failure(RuntimeError("unexpected position for record data/7")) is None
    assert is_storage_failure(RuntimeError("[Errno 2] No such file or directory")) is None
    assert is_storage_failure(OSError(errno.ENOENT, "missing")) is None
    assert is_storage_failure(ValueError("bad")) is None


def test_threads_of_one_process_write_one_file_at_once_without_taking_each_others_temporary(tmp_path):
    """The trainer's heartbeat thread and its main thread both write heartbeat/trainer.json: with one temporary name
    per process, one's rename moved the file from under the other's (FileNotFoundError, the trainer died)."""
    names, errors = [], []
    path = tmp_path / "beat.json"

    def write(k: int) -> None:
        names.append(tmp_name(path))
        try:
            for i in range(200):
                atomic_write_json(path, {"thread": k, "i": i})
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(names)) == 4 and not errors, (names, errors[:1])
    assert json.loads(path.read_text())["i"] == 199 and [p.name for p in tmp_path.iterdir()] == ["beat.json"]
