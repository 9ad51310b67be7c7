"""Taking back a commit whose shard is corrupt on disk, so that its producer writes the step again.

A committed shard can still go bad (a bit flipped by the storage, a truncated copy): StepReader then raises
CorruptShardError. A step no consumer has acked yet is not lost for that: its consumer (the trainer) calls
`quarantine_commit`, which moves the producer's commit record, its shards and a `reason.json` into

    traj/<stage>/step-N/quarantine/<producer>-<k>/      k = 0, 1, ... (each time the step is taken back)

With the record gone the step is uncommitted again: readers wait for it, and the producer's stage walk
(ShardWriter.is_committed) writes it anew, with the same prompts. Nothing is counted twice: the consumer never
trained on the corrupt step (it failed to read it), and a step some consumer has acked is refused here (its
trajectories are already in a checkpoint; the corrupt copy no longer matters). Readers list `<producer>.commit.json`
in the step directory only, so the quarantine folder is invisible to them and to the producer's leftover cleanup.
The rename of the commit record is the one step that matters and it is atomic; a crash before or after it leaves
the step either committed (corrupt: found again on the next read) or uncommitted (written again).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from rstar_hpc.exchange.atomic import atomic_write_json, fsync_dir
from rstar_hpc.exchange.errors import ExchangeError
from rstar_hpc.exchange.reader import consumer_cursors
from rstar_hpc.exchange.rundir import RunPaths

QUARANTINE = "quarantine"
MAX_QUARANTINES = 3   # the same step corrupt again and again: something systematic, a person should look
log = logging.getLogger(__name__)


def quarantine_dir(paths: RunPaths, stage: str, step: int) -> Path:
    return paths.traj_step_dir(stage, step) / QUARANTINE


def quarantined(paths: RunPaths, stage: str, step: int) -> list[dict]:
    """The reasons of every commit of `step` taken back so far, oldest first."""
    folder = quarantine_dir(paths, stage, step)
    out = []
    for name in sorted(os.listdir(folder)) if folder.is_dir() else []:
        try:
            out.append(json.loads((folder / name / "reason.json").read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            out.append({"entry": name, "reason": "unknown (no reason.json)"})
    return out


def quarantine_commit(paths: RunPaths, stage: str, step: int, producer: str, reason: str) -> Path:
    """Take back `producer`'s commit of `step` (see the module docstring); returns the quarantine folder."""
    acked = {name: nxt for name, nxt in consumer_cursors(paths, stage).items() if nxt > step}
    if acked:
        raise ExchangeError(
            f"step {step} of stage {stage!r} is corrupt ({reason}) but consumers {sorted(acked)} acked it already "
            f"(their cursors are past it): it is trained and must not be regenerated. Leave it, or delete the step "
            f"directory {paths.traj_step_dir(stage, step)} once no one needs its rows.")
    step_dir, record_path = paths.traj_step_dir(stage, step), paths.traj_commit(stage, step, producer)
    root = quarantine_dir(paths, stage, step)
    earlier = [n for n in (os.listdir(root) if root.is_dir() else []) if n.rsplit("-", 1)[0] == producer]
    if len(earlier) >= MAX_QUARANTINES:
        raise ExchangeError(
            f"step {step} of stage {stage!r} from producer {producer!r} is corrupt again ({reason}); it was "
            f"regenerated {len(earlier)} times already ({root}). Something corrupts files on this storage: check "
            f"the file system before running again.")
    try:
        record = json.loads(record_path.read_text())
    except FileNotFoundError:
        raise ExchangeError(f"{record_path} is gone: step {step} was taken back already (by another reader?)") \
            from None
    except json.JSONDecodeError:
        record = {"shards": []}
    folder = root / f"{producer}-{len(earlier)}"
    folder.mkdir(parents=True)
    atomic_write_json(folder / "reason.json", {
        "stage": stage, "step": step, "producer": producer, "reason": reason, "commit": record,
        "time": time.time(), "host": socket.gethostname(), "pid": os.getpid(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID")}, what="quarantine reason")
    os.rename(record_path, folder / record_path.name)   # the step is uncommitted from here on
    fsync_dir(step_dir)
    for shard in record.get("shards", []):
        try:   # kept for a post-mortem; a new attempt of the producer removes them if it gets there first
            os.rename(step_dir / shard["file"], folder / shard["file"])
        except FileNotFoundError:
            pass
    log.warning("step %d of stage %s: took back %s's commit (%s); moved to %s, the step will be written again",
                step, stage, producer, reason, folder)
    return folder
