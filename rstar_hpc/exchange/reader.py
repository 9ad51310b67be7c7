"""Reading trajectory steps: only committed data, checksummed, memory-mapped, with the explicit schema.

    reader = StepReader(paths, stage="rl-8k")
    reader.wait(12, producers=["rollout-0", "rollout-1"], timeout_s=600)   # StepNotReadyError names the missing
    table = reader.read(12)                                              # pyarrow Table backed by the mmap
    trajs = from_table(table)                                            # or Trajectory rows (columns.py)

    consumer = Consumer(paths, stage="rl-8k", name="trainer", producers=[...])
    batch = consumer.wait(timeout_s=600)          # the step after the last acked one
    ...train on batch.table...
    consumer.ack(batch.step, state={...})         # cursor (and your state) committed atomically, once

A reader opens exactly the files commit records list (never a glob), checks each one's size and sha256, and
then maps it; anything else in a step directory (tmp files, shards of a crashed attempt) is invisible.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Sequence

import pyarrow as pa

from rstar_hpc.exchange.atomic import atomic_write_json
from rstar_hpc.exchange.columns import conform, from_table
from rstar_hpc.exchange.commit import load_commit_record
from rstar_hpc.exchange.errors import CorruptShardError, ExchangeError, StepNotReadyError
from rstar_hpc.exchange.poll import Backoff
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.schema import SCHEMA, Trajectory


class StepReader:
    def __init__(self, paths: RunPaths, stage: str, *, verify: bool = True):
        self.paths, self.stage, self.verify = paths, stage, verify

    def commits(self, step: int) -> dict[str, dict]:
        """Commit records of `step`, by producer (only producers that committed)."""
        return {producer: load_commit_record(path, step, producer)
                for producer, path in self.paths.traj_commits(self.stage, step).items()}

    def wait(self, step: int, producers: Sequence[str], timeout_s: float, poll_s: float = 0.5) -> dict[str, dict]:
        """Block until every producer in `producers` committed `step`; StepNotReadyError lists the missing ones."""
        start, backoff = time.monotonic(), Backoff(max_s=poll_s)
        while True:
            records = self.commits(step)
            missing = [p for p in producers if p not in records]
            if not missing:
                return {p: records[p] for p in producers}
            waited = time.monotonic() - start
            if waited >= timeout_s:
                raise StepNotReadyError(str(self.paths.traj_step_dir(self.stage, step)), step, missing,
                                        sorted(records), waited)
            backoff.sleep(cap_s=max(timeout_s - waited, 0.01))

    def read(self, step: int, producers: Sequence[str] | None = None,
             records: dict[str, dict] | None = None) -> pa.Table:
        """The committed rows of `step` (of `producers`, default all committed), producer by producer."""
        records = records if records is not None else self.commits(step)
        if producers is not None:
            missing = [p for p in producers if p not in records]
            if missing:
                raise StepNotReadyError(str(self.paths.traj_step_dir(self.stage, step)), step, missing,
                                        sorted(records), 0.0)
            records = {p: records[p] for p in producers}
        folder = self.paths.traj_step_dir(self.stage, step)
        batches: list[pa.RecordBatch] = []
        for producer in sorted(records):
            for shard in records[producer]["shards"]:
                batches.extend(self._read_shard(os.path.join(folder, shard["file"]), shard))
        return pa.Table.from_batches(batches, schema=SCHEMA)

    def _read_shard(self, path: str, expect: dict) -> list[pa.RecordBatch]:
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise CorruptShardError(path, "listed in the commit record but missing") from None
        if size != expect["bytes"]:
            raise CorruptShardError(path, f"size {size} bytes, commit record says {expect['bytes']} (torn write?)")
        mapped = pa.memory_map(path, "r")
        buf = mapped.read_buffer()
        if self.verify:
            digest = hashlib.sha256(memoryview(buf)).hexdigest()
            if digest != expect["sha256"]:
                raise CorruptShardError(path, f"sha256 {digest[:16]}... differs from the commit record's "
                                              f"{expect['sha256'][:16]}...")
        try:
            stream = pa.ipc.open_stream(buf)
            batches = [conform(b) for b in stream]
        except (pa.ArrowInvalid, OSError) as e:
            raise CorruptShardError(path, f"not a readable Arrow stream ({e})") from None
        rows = sum(b.num_rows for b in batches)
        if rows != expect["rows"]:
            raise CorruptShardError(path, f"{rows} rows, commit record says {expect['rows']}")
        return batches


@dataclass
class StepBatch:
    step: int
    table: pa.Table
    commits: dict[str, dict]

    def trajectories(self) -> list[Trajectory]:
        return from_table(self.table)


class Consumer:
    """Exactly-once consumption of consecutive steps across restarts.

    The cursor `stages/<stage>/cursors/<name>.json` holds the next step and your `state`, replaced atomically by
    `ack`. A step is delivered again after a crash until it is acked, so commit the effects of a step *in* the
    ack's `state` (e.g. the checkpoint it went into), or make them idempotent per step: then every step counts
    exactly once.
    """

    def __init__(self, paths: RunPaths, stage: str, name: str, producers: Sequence[str], *, first_step: int = 0,
                 verify: bool = True):
        self.reader = StepReader(paths, stage, verify=verify)
        self.producers = list(producers)
        self.path = paths.cursor(stage, name)
        try:
            cursor = json.loads(self.path.read_text())
        except FileNotFoundError:
            cursor = {"next_step": first_step, "state": None, "history": []}
        except json.JSONDecodeError as e:
            raise ExchangeError(f"{self.path}: unreadable cursor ({e}); it is written atomically, so something "
                                f"else wrote it. Restore it or delete it to start from step {first_step}.") from None
        self.next_step: int = cursor["next_step"]
        self.state = cursor["state"]
        self._history: list[dict] = cursor.get("history", [])

    def wait(self, timeout_s: float, poll_s: float = 0.5) -> StepBatch:
        records = self.reader.wait(self.next_step, self.producers, timeout_s, poll_s)
        return StepBatch(self.next_step, self.reader.read(self.next_step, records=records), records)

    def ack(self, step: int, state: object = None) -> None:
        if step != self.next_step:
            raise ExchangeError(f"ack({step}) but the cursor {self.path} expects step {self.next_step}; steps are "
                                f"acked once, in order")
        history = (self._history + [{"step": step, "acked_at": time.time()}])[-100:]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.path, {"next_step": step + 1, "state": state, "history": history},
                          what="consumer cursor")
        self.next_step, self.state, self._history = step + 1, state, history


def consumer_cursors(paths: RunPaths, stage: str) -> dict[str, int]:
    """next_step of every consumer of `stage` (what retention must not delete)."""
    folder = paths.cursor(stage, "x").parent
    out = {}
    for name in sorted(os.listdir(folder)) if folder.is_dir() else []:
        if name.endswith(".json") and not name.startswith("."):
            out[name[:-5]] = json.loads((folder / name).read_text())["next_step"]
    return out
