"""Rows of a data file (JSONL or Parquet), and the error every data reader raises."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

class DatasetError(ValueError):
    """Data that cannot be used; the message names the file, the row and the fix. `rstar-hpc` exits 3 on it."""


class DataFileMissing(DatasetError, FileNotFoundError):
    """A data file that does not exist (both a DatasetError and a FileNotFoundError)."""


@dataclass(frozen=True)
class Rows:
    path: Path
    rows: list[dict]
    lines: list[int]
    """Each row's line in a JSONL file (its row number in a Parquet file), for messages."""
    parquet: bool

    def columns(self) -> list[str]:
        """The columns: the Parquet schema's, or every key of the first 100 JSONL rows."""
        seen: dict[str, None] = {}
        for row in self.rows[:100]:
            seen.update(dict.fromkeys(row))
        return list(seen)


def read_rows(path: str | Path, missing_hint: str) -> Rows:
    """Every row of a JSONL (one JSON object a line, blank lines skipped) or Parquet file, as dicts."""
    path = Path(path)
    if not path.is_file():
        raise DataFileMissing(f"{path}: no such data file; {missing_hint}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:   # pyarrow raises several types for a bad file
            raise DatasetError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from e
        return Rows(path, rows, list(range(1, len(rows) + 1)), True)
    rows, lines = [], []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{n}: not a JSON object ({e}); each line is one row (JSON lines; a Parquet "
                               f"file needs the .parquet suffix)") from e
        if not isinstance(row, dict):
            raise DatasetError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
        lines.append(n)
    return Rows(path, rows, lines, False)


def maybe_json(value):
    """A cell that a writer stored as a JSON string (HF datasets do this for mixed-type columns), decoded; any
    other value as it is."""
    if isinstance(value, str) and value[:1] in "[{":
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def content_text(content, where: str) -> str:
    """A message's content as text: a string, null (empty), or a list of parts [{"type": "text", "text": ...}]
    (OpenAI's form; the parts are joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise DatasetError(f"{where}: a content part of type {kind!r}; only text parts ({{\"type\": \"text\", "
                                   f"\"text\": ...}}) can be trained on or prompted with")
        return "".join(texts)
    raise DatasetError(f"{where}: content must be a string, null or a list of text parts, not "
                       f"{type(content).__name__}")
