"""ShardWriter: one producer's trajectories for one step, published so readers never see a partial step.

Protocol (see docs/run-directory.md):
  1. Each shard is an Arrow IPC *stream* (uncompressed: readers memory-map it zero-copy), written under a tmp
     name in the step directory itself, fsynced, then `os.replace`d onto `<producer>-<seq>-<attempt>.arrows`.
  2. `commit()` writes `<producer>.commit.json` last, atomically: shard names, row counts, byte sizes, sha256
     (commit.py).
     Only that record makes the shards visible; shards it does not list are leftovers of a crashed attempt.
One writer per producer per step, so there are no locks: names are unique per producer, and the attempt token
keeps a zombie of an earlier attempt from clobbering the files of the current one.

    writer = ShardWriter(paths, stage="rl-8k", step=12, producer="rollout-3")
    writer.write(trajectories)          # as often as needed; rolls to a new shard every max_rows_per_shard
    writer.commit()                     # the step is now visible for this producer
"""
from __future__ import annotations

import hashlib
import os
import re
import secrets
from typing import Sequence

import pyarrow as pa

from rstar_hpc.exchange.atomic import atomic_write_json, fsync_dir, is_tmp, tmp_name, unlink_quietly
from rstar_hpc.exchange.columns import to_record_batches
from rstar_hpc.exchange.commit import commit_record
from rstar_hpc.exchange.errors import ExchangeError, StorageError, is_storage_failure, storage_guard
from rstar_hpc.exchange.rundir import COMMIT_SUFFIX, RunPaths
from rstar_hpc.exchange.schema import SCHEMA, Trajectory


class ShardWriter:
    def __init__(self, paths: RunPaths, stage: str, step: int, producer: str, *, max_rows_per_shard: int = 4096,
                 validate: bool = True):
        self.paths, self.stage, self.step, self.producer = paths, stage, step, producer
        self.max_rows_per_shard, self.validate = max_rows_per_shard, validate
        self.step_dir = paths.traj_step_dir(stage, step)
        self.commit_path = paths.traj_commit(stage, step, producer)
        if os.path.exists(self.commit_path):
            raise ExchangeError(
                f"{self.commit_path} exists: producer {producer!r} already committed step {step} of stage "
                f"{stage!r}. A restarted producer must skip committed steps (ShardWriter.is_committed), not "
                f"write them twice.")
        with storage_guard(self.step_dir, "trajectory step directory"):
            os.makedirs(self.step_dir, exist_ok=True)
        self._attempt = secrets.token_hex(4)
        self._shards: list[dict] = []
        self._open: _OpenShard | None = None
        self._committed = False
        self._remove_leftovers()

    @staticmethod
    def is_committed(paths: RunPaths, stage: str, step: int, producer: str) -> bool:
        return os.path.exists(paths.traj_commit(stage, step, producer))

    def write(self, trajectories: Sequence[Trajectory]) -> None:
        if self._committed:
            raise ExchangeError(f"write() after commit() for {self.commit_path}; open a ShardWriter for the next step")
        for t in trajectories:
            if t.step != self.step or t.stage != self.stage:
                raise ValueError(f"trajectory {t.prompt_uid!r} is for stage {t.stage!r} step {t.step}, "
                                 f"this writer for stage {self.stage!r} step {self.step}")
            if self.validate:
                t.validate()
        pos = 0
        try:
            while pos < len(trajectories):
                if self._open is None:
                    self._open = _OpenShard(self.step_dir, self._shard_name(len(self._shards)))
                take = min(len(trajectories) - pos, self.max_rows_per_shard - self._open.rows)
                for batch in to_record_batches(trajectories[pos:pos + take]):
                    self._open.write(batch)
                pos += take
                if self._open.rows >= self.max_rows_per_shard:
                    self._shards.append(self._open.publish())
                    self._open = None
        except BaseException as e:
            self._storage_failure(e, self._shard_name(len(self._shards)), "trajectory shard")
            raise

    def commit(self) -> dict:
        """Publish the open shard, then the commit record; returns the record."""
        if self._committed:
            raise ExchangeError(f"{self.commit_path} already committed by this writer")
        try:
            if self._open is not None:
                self._shards.append(self._open.publish())
                self._open = None
            record = commit_record(self.paths.name, self.stage, self.step, self.producer, self._shards)
            atomic_write_json(self.commit_path, record, what="trajectory commit record")
        except BaseException as e:
            self._storage_failure(e, self._shard_name(len(self._shards)), "trajectory shard")
            raise
        self._committed = True
        return record

    def _storage_failure(self, e: BaseException, shard: str, what: str) -> None:
        """On a full or failing file system: drop this attempt's files (they hold the space a retry needs; no
        commit record lists them) and raise StorageError naming the file. Other errors are the caller's."""
        if isinstance(e, StorageError):
            self.abort()
            raise e
        found = is_storage_failure(e)
        if found is not None:
            err = StorageError(os.path.join(self.step_dir, shard), what, found)   # free space before the cleanup
            self.abort()
            raise err from e

    def abort(self) -> None:
        """Drop what this attempt wrote (readers never saw it)."""
        if self._open is not None:
            self._open.discard()
            self._open = None
        for s in self._shards:
            _unlink(os.path.join(self.step_dir, s["file"]))
        self._shards = []

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._committed:
            self.commit()

    def _shard_name(self, seq: int) -> str:
        return f"{self.producer}-{seq:04d}-{self._attempt}.arrows"

    def _remove_leftovers(self) -> None:
        # uncommitted shards and tmp files of an earlier, crashed attempt of this producer; never listed anywhere
        own = rf"{re.escape(self.producer)}(-\d+-[0-9a-f]+\.arrows|{re.escape(COMMIT_SUFFIX)})"
        mine = re.compile(rf"\.?{own}(\.tmp-.*)?")
        for name in os.listdir(self.step_dir):
            if mine.fullmatch(name) and (name.endswith(".arrows") or is_tmp(name)):
                _unlink(os.path.join(self.step_dir, name))


class _OpenShard:
    """A shard being written under its tmp name, hashed as it streams out."""

    def __init__(self, folder: str, name: str):
        self.name, self.final = name, os.path.join(folder, name)
        self.tmp = tmp_name(self.final)
        self.rows = 0
        self._file = open(self.tmp, "wb")
        self._sink = _HashingSink(self._file)
        self._stream = pa.ipc.new_stream(self._sink, SCHEMA)

    def write(self, batch: pa.RecordBatch) -> None:
        self._stream.write_batch(batch)
        self.rows += batch.num_rows

    def publish(self) -> dict:
        self._stream.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.tmp, self.final)
        fsync_dir(os.path.dirname(self.final))
        return {"file": self.name, "rows": self.rows, "bytes": self._sink.size, "sha256": self._sink.hexdigest()}

    def discard(self) -> None:
        try:
            self._file.close()   # flushes what is buffered: may fail again on a full disk
        except OSError:
            pass
        _unlink(self.tmp)


class _HashingSink:
    """File-like object for pyarrow: checksums the bytes on their way out, so publish needs no re-read."""

    def __init__(self, f):
        self._f, self._hash, self.size, self.closed = f, hashlib.sha256(), 0, False

    def write(self, data) -> int:
        view = memoryview(data)
        self._hash.update(view)
        self._f.write(view)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self.closed = True   # the file is closed by publish(), after fsync

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _unlink(path: str) -> None:
    unlink_quietly(path)

