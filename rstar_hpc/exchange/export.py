"""Copies of committed trajectory rows in formats other tools read (`rstar-hpc traj export`)."""
from __future__ import annotations

import os

import pyarrow as pa

from rstar_hpc.exchange.atomic import atomic_write_bytes
from rstar_hpc.exchange.columns import from_table


def export_table(table: pa.Table, path: str | os.PathLike, fmt: str) -> int:
    """Copy committed rows to Parquet or JSON Lines, published atomically like everything else; returns rows."""
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression="zstd")
        atomic_write_bytes(path, sink.getvalue().to_pybytes())
    elif fmt == "jsonl":
        atomic_write_bytes(path, "".join(t.to_json() + "\n" for t in from_table(table)).encode())
    else:
        raise ValueError(f"export format {fmt!r}: use 'parquet' or 'jsonl'")
    return table.num_rows
