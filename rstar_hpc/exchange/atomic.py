"""Publishing on shared storage: a reader sees the old file or the whole new one, never a part.

Write a temporary name in the *same* directory (rename is atomic only within one file system), fsync the file,
`os.replace` it onto the final name, fsync the directory so the rename survives a node crash. Stdlib only:
the sandbox service imports this through `rendezvous`.
"""
from __future__ import annotations

import json
import os
import socket

TMP_MARK = ".tmp-"   # every temporary name contains this; readers and listings skip such names


def tmp_name(path: str | os.PathLike) -> str:
    """A sibling temporary name unique to this host and process (several writers may race for one path)."""
    head, tail = os.path.split(os.fspath(path))
    return os.path.join(head, f".{tail}{TMP_MARK}{socket.gethostname()}-{os.getpid()}")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = os.fspath(path)
    tmp = tmp_name(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, record: object) -> None:
    atomic_write_text(path, json.dumps(record, indent=1, sort_keys=True) + "\n")


def fsync_dir(folder: str | os.PathLike) -> None:
    """Persist renames in `folder`; some file systems refuse fsync on a directory, so this is best effort."""
    try:
        fd = os.open(os.fspath(folder), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_tmp(name: str) -> bool:
    return TMP_MARK in name
