"""A step's trajectories as Arrow columns: built from `Trajectory` rows, read back, and conformed to the schema.

    table = to_table(trajectories)             # what ShardWriter streams, batch by batch (to_record_batches)
    trajectories = from_table(table)           # rows back, token fields as numpy arrays
    values, offsets = token_view(table, "response_ids")

The schema itself (field names, types, the `Trajectory` row) is schema.py; this module only moves data between
that row form and columns.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import pyarrow as pa

from rstar_hpc.exchange.schema import SCALAR_COLUMNS, SCHEMA, TOKEN_COLUMNS, Timings, ToolCall, Trajectory, Turn

_MAX_OFFSET = 2**31 - 1   # list<...> offsets are int32


# --------------------------------------------------------------------------------------------------- rows -> columns
def to_record_batches(trajectories: Sequence[Trajectory]) -> Iterable[pa.RecordBatch]:
    """Columnar conversion; token lists go through numpy (one concatenate per column, no per-token Python).

    Splits so that no list column exceeds int32 offsets."""
    start = 0
    while start < len(trajectories):
        end, tokens = start, 0
        while end < len(trajectories) and (end == start or tokens + _ntokens(trajectories[end]) <= _MAX_OFFSET):
            tokens += _ntokens(trajectories[end])
            end += 1
        yield _batch(trajectories[start:end])
        start = end


def to_table(trajectories: Sequence[Trajectory]) -> pa.Table:
    return pa.Table.from_batches(list(to_record_batches(trajectories)), schema=SCHEMA)


def _ntokens(t: Trajectory) -> int:
    return max(len(t.prompt_ids), len(t.response_ids))


def _batch(trajs: Sequence[Trajectory]) -> pa.RecordBatch:
    columns: dict[str, pa.Array] = {}
    for f in SCHEMA:
        if f.name in SCALAR_COLUMNS:
            values = [getattr(t, f.name) for t in trajs]
            if f.name in ("turns", "tool_calls"):
                values = [[vars(item) for item in v] for v in values]
            elif f.name == "timings":
                values = [vars(v) for v in values]
            columns[f.name] = pa.array(values, type=f.type)
        else:
            columns[f.name] = _list_array([getattr(t, f.name) for t in trajs], f.type)
    return pa.RecordBatch.from_arrays([columns[f.name] for f in SCHEMA], schema=SCHEMA)


def _list_array(rows: list, type_: pa.ListType) -> pa.Array:
    dtype = type_.value_type.to_pandas_dtype()
    parts = [np.asarray(r, dtype=dtype) for r in rows]
    offsets = np.zeros(len(parts) + 1, dtype=np.int32)
    np.cumsum([p.size for p in parts], out=offsets[1:])
    values = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, type_.value_type), type=type_)


# --------------------------------------------------------------------------------------------------- columns -> rows
def conform(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Map a shard's batch onto SCHEMA: same columns pass zero-copy; columns added later come back as nulls."""
    if batch.schema.equals(SCHEMA, check_metadata=False):
        return batch
    columns = []
    for f in SCHEMA:
        i = batch.schema.get_field_index(f.name)
        if i >= 0:
            if not batch.schema.field(i).type.equals(f.type):
                raise pa.ArrowInvalid(f"column {f.name!r} is {batch.schema.field(i).type}, schema says {f.type}")
            columns.append(batch.column(i))
        elif f.nullable:
            columns.append(pa.nulls(batch.num_rows, f.type))
        else:
            raise pa.ArrowInvalid(f"required column {f.name!r} is missing")
    return pa.RecordBatch.from_arrays(columns, schema=SCHEMA)


def token_view(table: pa.Table, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of a token column as numpy; zero-copy when the table is one batch (one shard)."""
    chunked = table.column(column)
    arr = chunked.chunk(0) if chunked.num_chunks == 1 else chunked.combine_chunks()
    offsets = arr.offsets.to_numpy()
    return arr.values.to_numpy(zero_copy_only=False), offsets


def from_table(table: pa.Table) -> list[Trajectory]:
    out: list[Trajectory] = []
    for batch in table.to_batches():
        cols = {name: batch.column(name).to_pylist() for name in SCALAR_COLUMNS}
        tokens = {}
        for name in TOKEN_COLUMNS:
            arr = batch.column(name)
            tokens[name] = (arr.values.to_numpy(zero_copy_only=False), arr.offsets.to_numpy())
        for i in range(batch.num_rows):
            row = {name: cols[name][i] for name in SCALAR_COLUMNS}
            row["turns"] = [Turn(**t) for t in row["turns"]]
            row["tool_calls"] = [ToolCall(**c) for c in row["tool_calls"]]
            row["timings"] = Timings(**row["timings"])
            for name, (values, offsets) in tokens.items():
                row[name] = values[offsets[i]:offsets[i + 1]]
            out.append(Trajectory(**row))
    return out
