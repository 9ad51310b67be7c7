"""Streaming reads of a role's JSONL metrics: one line at a time, so a long run's file never sits in memory."""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ReadCounts:
    records: int = 0
    bad_lines: int = 0   # not JSON objects: a torn last line of a preempted job, or a foreign line


def iter_records(path: Path, counts: ReadCounts | None = None) -> Iterator[dict]:
    """The JSON objects of `path`, in order; a missing file yields nothing."""
    counts = counts if counts is not None else ReadCounts()
    try:
        f = open(path, encoding="utf-8", errors="replace")   # noqa: SIM115  (closed below)
    except FileNotFoundError:
        return
    with f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                counts.bad_lines += 1
                continue
            if isinstance(record, dict):
                counts.records += 1
                yield record
            else:
                counts.bad_lines += 1
