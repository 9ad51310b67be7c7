"""The shared-storage exchange: how roles meet through files in the run directory (never Ray/Redis).

    rundir.py      RunPaths: every location of a run (the layout is documented there) and Lustre striping
    state.py       StageState (PENDING/RUNNING/DONE/FAILED, step, data cursor, policy version), atomic
    checkpoints.py CommittedDirs: checkpoint / policy directories, commit marker, `latest` pointer, retention
    schema.py      the one trajectory schema (versioned) and the `Trajectory` dataclass
    writer.py      ShardWriter: per-producer shards of a step, published atomically, commit record last
    reader.py      StepReader / Consumer: read only committed steps, checksums, exactly-once cursor
    retention.py   prune consumed trajectory steps
    rendezvous.py  host/port announcements (stdlib only, safe to import from the sandbox service)
    atomic.py      tmp + fsync + rename publishing (stdlib only)

Importing this package is cheap: pyarrow is loaded only by writer/reader/schema, on first use.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "RunPaths": "rundir", "StageState": "state", "read_stage_state": "state", "write_stage_state": "state",
    "CommittedDirs": "checkpoints", "prune_trajectories": "retention", "from_table": "reader",
    "Trajectory": "schema", "ToolCall": "schema", "SCHEMA_VERSION": "schema",
    "ShardWriter": "writer", "StepReader": "reader", "Consumer": "reader",
    "ExchangeError": "errors", "CorruptShardError": "errors", "StepNotReadyError": "errors",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'rstar_hpc.exchange' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rstar_hpc.exchange.{_LAZY[name]}"), name)


__all__ = sorted(_LAZY)
