"""Read back what W&B wrote offline (RUN/wandb/offline-run-*/run-<id>.wandb): the tests assert on the logged
values themselves. The file is W&B's header (':W&B', magic 0xBEE1, version 0) then a LevelDB log of protobuf
Records: 32 KiB blocks of chunks, each checksum(4) length(2, LE) type(1: full, 2: first, 3: middle, 4: last)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7


def records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:   # a block's tail too short for a chunk header is padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            yield rec


def history(path: Path) -> list[dict]:
    """Every `run.log` row in the file, as {key: value}."""
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            for rec in records(path) if rec.WhichOneof("record_type") == "history"]


def config(path: Path) -> dict:
    """The run's config (hyperparameters), merged over its config records."""
    out = {}
    for rec in records(path):
        if rec.WhichOneof("record_type") in ("config", "run"):
            items = rec.config.update if rec.WhichOneof("record_type") == "config" else rec.run.config.update
            out.update({i.key: json.loads(i.value_json) for i in items})
    return out


def run_files(run_dir: Path, run_id: str) -> list[Path]:
    """The offline run files of W&B run `run_id`, oldest first (a requeued role writes one per job)."""
    return sorted(run_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
