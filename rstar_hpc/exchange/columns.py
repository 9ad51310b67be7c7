"""A step's trajectories as Arrow columns: built from `Trajectory` rows, read back, read column by column.

    table = to_table(trajectories)             # what ShardWriter streams, batch by batch (to_record_batches)
    trajectories = from_table(table)           # rows back, token fields as numpy arrays
    cols = TrajectoryColumns(table)            # typed columns by attribute: cols.reward, cols.response_ids, ...

The schema itself (field names, types, the `Trajectory` row) is schema.py; this module only moves data between
that row form and columns. Consumers that read columns (the trainer) use `TrajectoryColumns`, so a column name is
spelled in schema.py and here, nowhere else.
"""
from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rstar_hpc.exchange.schema import SCALAR_COLUMNS, SCHEMA, TOKEN_COLUMNS, Timings, ToolCall, Trajectory, Turn

_MAX_OFFSET = 2**31 - 1   # list<...> offsets are int32


class TokenColumn(NamedTuple):
    """A list column as numpy: row i is values[offsets[i]:offsets[i + 1]] (zero-copy for a one-shard table)."""
    values: np.ndarray
    offsets: np.ndarray

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def row_sums(self, flags: np.ndarray) -> np.ndarray:
        """Per row, the sum of `flags` (one per value) over that row's values."""
        c = np.concatenate([[0], np.cumsum(flags)])
        return c[self.offsets[1:]] - c[self.offsets[:-1]]


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
            elif f.name == "token_policy_versions":
                values = [None if v is None else np.asarray(v, dtype=np.int32) for v in values]
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


def token_view(table: pa.Table, column: str) -> TokenColumn:
    """(values, offsets) of a token column as numpy; zero-copy when the table is one batch (one shard)."""
    return _token_column(table.column(column))


def _token_column(column: pa.ChunkedArray) -> TokenColumn:
    arr = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    return TokenColumn(arr.values.to_numpy(zero_copy_only=False), arr.offsets.to_numpy())


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
            if row["token_policy_versions"] is not None:
                row["token_policy_versions"] = np.asarray(row["token_policy_versions"], dtype=np.int32)
            for name, (values, offsets) in tokens.items():
                row[name] = values[offsets[i]:offsets[i + 1]]
            out.append(Trajectory(**row))
    return out


# --------------------------------------------------------------------------------------------------- typed columns
class _Column:
    """A descriptor named after its schema field (checked when the class is built)."""

    def __set_name__(self, owner: type, name: str) -> None:
        if name not in SCHEMA.names:
            raise TypeError(f"{owner.__name__}.{name}: no column {name!r} in the trajectory schema")
        self.name = name

    def __get__(self, cols: TrajectoryColumns | None, owner: type) -> Any:
        return self if cols is None else self.read(cols.table.column(self.name))

    def read(self, column: pa.ChunkedArray) -> Any:
        raise NotImplementedError


class _Numbers(_Column):
    def read(self, column: pa.ChunkedArray) -> np.ndarray:
        return column.to_numpy()


class _Texts(_Column):
    """Strings as a numpy array (None where null)."""

    def read(self, column: pa.ChunkedArray) -> np.ndarray:
        return np.asarray(column.to_pylist())


class _Tokens(_Column):
    def read(self, column: pa.ChunkedArray) -> TokenColumn:
        return _token_column(column)


class TrajectoryColumns:
    """Typed, read-only columns of a trajectory table (what StepReader.read returns), one attribute per column.

        cols = TrajectoryColumns(table)
        cols.reward                      # float32, one per row
        cols.prompt_uid                  # str
        ids, offsets = cols.response_ids # TokenColumn
    """

    run = _Texts()
    stage = _Texts()
    step = _Numbers()
    prompt_uid = _Texts()
    sample_index = _Numbers()
    policy_version = _Numbers()
    engine_rank = _Numbers()
    prompt_ids = _Tokens()
    response_ids = _Tokens()
    loss_mask = _Tokens()
    logprobs = _Tokens()
    prompt_text = _Texts()
    finish_reason = _Texts()
    answer = _Texts()
    reward = _Numbers()
    p_err = _Numbers()
    p_format = _Numbers()
    token_policy_versions = _Tokens()
    """Null rows (the trajectory was never paused) come back empty: see token_versions()."""

    def __init__(self, table: pa.Table):
        self.table = table

    def __len__(self) -> int:
        return self.table.num_rows

    def token_versions(self) -> TokenColumn:
        """The policy version of every response token, aligned with response_ids: token_policy_versions where a
        row has it, else the row's policy_version repeated."""
        _, offsets = self.response_ids
        lengths = np.diff(offsets)
        out = np.repeat(self.policy_version.astype(np.int32), lengths)
        col = self.table.column("token_policy_versions")
        if col.null_count < len(col):
            vals, voff = self.token_policy_versions
            for i in np.flatnonzero(np.diff(voff)):
                out[offsets[i]:offsets[i + 1]] = vals[voff[i]:voff[i + 1]]
        return TokenColumn(out, offsets)

    @property
    def tool_call_status(self) -> TokenColumn:
        """The status of every tool call, row by row (rows' calls at values[offsets[i]:offsets[i + 1]])."""
        calls = self.table.column("tool_calls").combine_chunks()
        status = pc.struct_field(calls.values, "status").to_numpy(zero_copy_only=False)
        return TokenColumn(status, calls.offsets.to_numpy())
