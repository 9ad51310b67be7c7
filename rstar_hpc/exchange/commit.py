"""The commit record of a trajectory step: the one file that makes a producer's shards visible.

`<run>/traj/<stage>/step-N/<producer>.commit.json` (the name is rundir.py's), written last and atomically by
ShardWriter.commit, read by StepReader. It lists exactly the shards readers may open:

    {"format": "rstar-hpc/traj-commit", "schema_version": 1, "schema_fingerprint": "...",
     "run": ..., "stage": ..., "step": N, "producer": ..., "rows": R,
     "shards": [{"file": "<producer>-0000-<attempt>.arrows", "rows": ..., "bytes": ..., "sha256": ...}, ...],
     "host": ..., "pid": ..., "slurm_job_id": ... | null, "committed_at": <unix s>}
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from rstar_hpc.exchange.errors import ExchangeError
from rstar_hpc.exchange.schema import FINGERPRINT, SCHEMA_VERSION

COMMIT_FORMAT = "rstar-hpc/traj-commit"


def commit_record(run: str, stage: str, step: int, producer: str, shards: list[dict]) -> dict:
    """The record a producer commits for `shards` (each {"file", "rows", "bytes", "sha256"}), stamped now."""
    return {
        "format": COMMIT_FORMAT, "schema_version": SCHEMA_VERSION, "schema_fingerprint": FINGERPRINT,
        "run": run, "stage": stage, "step": step, "producer": producer,
        "rows": sum(s["rows"] for s in shards), "shards": shards,
        "host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "committed_at": time.time(),
    }


def load_commit_record(path: Path, step: int, producer: str) -> dict:
    """The record at `path`, checked to be `producer`'s for `step` in a schema this reader understands."""
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ExchangeError(f"{path}: unreadable commit record ({e}); commit records are written atomically, "
                            f"so something else wrote it. Delete it and re-run producer {producer!r}.") from None
    if record.get("format") != COMMIT_FORMAT or record.get("step") != step or record.get("producer") != producer:
        raise ExchangeError(f"{path}: not a commit record of producer {producer!r} for step {step} "
                            f"(format={record.get('format')!r}, step={record.get('step')!r}, "
                            f"producer={record.get('producer')!r})")
    if record["schema_version"] > SCHEMA_VERSION:
        raise ExchangeError(f"{path}: written with trajectory schema v{record['schema_version']}, this "
                            f"rstar-hpc reads up to v{SCHEMA_VERSION}; upgrade rstar-hpc on the reader.")
    return record
