"""The shared-storage exchange: how roles meet through files in the run directory (never Ray/Redis).

The contract every role imports; it imports no role (tests/unit/test_layout.py checks). Stdlib only:

    atomic.py       tmp + fsync + rename publishing
    rendezvous.py   host/port announcements: how a role finds another (the sandbox service imports it)
    tool_status.py  the tool-call statuses (all, failed, infrastructure) the sandbox, agent and algorithm share
    rundir.py       RunPaths: every location of a run (the layout is documented there) and Lustre striping
    state.py        StageState (PENDING/RUNNING/DONE/FAILED, step, data cursor, policy version), atomic
    checkpoints.py  CommittedDirs: checkpoint / policy directories, commit marker, `latest` pointer, retention
    policy_versions.py  policy versions: the run-global numbering, the in-memory offer's record, look-ups by need
    errors.py       ExchangeError and its kinds; StorageError: a write refused by full or failing storage (path,
                    free space), raised by every write of the exchange, nothing partial left visible
With pyarrow (the trajectory data):
    schema.py       the one trajectory schema (versioned) and the `Trajectory` row
    columns.py      Trajectory rows <-> Arrow columns (to_table, from_table, conform, token_view)
    commit.py       the commit record that makes a producer's shards of a step visible
    writer.py       ShardWriter: per-producer shards of a step, published atomically, commit record last
    reader.py       StepReader / Consumer: read only committed steps, checksums, exactly-once cursor
    retention.py    prune consumed trajectory steps
    quarantine.py   take back the commit of a step whose shard is corrupt on disk, so its producer writes it again
    export.py       Parquet / JSON Lines copies of committed steps

Importing this package is cheap: names below are loaded on first use, so `import rstar_hpc.exchange.rendezvous`
pulls in the stdlib only.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "RunPaths": "rundir", "StageState": "state", "read_stage_state": "state", "write_stage_state": "state",
    "CommittedDirs": "checkpoints", "prune_trajectories": "retention", "from_table": "columns", "to_table": "columns",
    "Trajectory": "schema", "ToolCall": "schema", "SCHEMA_VERSION": "schema", "TOOL_STATUSES": "tool_status",
    "ShardWriter": "writer", "StepReader": "reader", "Consumer": "reader",
    "ExchangeError": "errors", "CorruptShardError": "errors", "StepNotReadyError": "errors",
    "StorageError": "errors",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'rstar_hpc.exchange' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rstar_hpc.exchange.{_LAZY[name]}"), name)


__all__ = sorted(_LAZY)
