"""Publishing on shared storage: a reader sees the old file or the whole new one, never a part.

Write a temporary name in the *same* directory (rename is atomic only within one file system), fsync the file,
`os.replace` it onto the final name, fsync the directory so the rename survives a node crash. Stdlib only:
the sandbox service imports this through `rendezvous`.
"""
from __future__ import annotations

import json
import os
import socket
import threading

from rstar_hpc.exchange.errors import storage_guard

TMP_MARK = ".tmp-"   # every temporary name contains this; readers and listings skip such names


def tmp_name(path: str | os.PathLike) -> str:
    """A sibling temporary name unique to this host, process and thread (several writers may race for one path:
    the trainer's heartbeat thread and its main thread both write heartbeat/trainer.json, and with one name per
    process one's rename took the file from under the other's)."""
    head, tail = os.path.split(os.fspath(path))
    return os.path.join(head, f".{tail}{TMP_MARK}{socket.gethostname()}-{os.getpid()}-{threading.get_native_id()}")


def atomic_write_bytes(path: str | os.PathLike, data: bytes, what: str = "file") -> None:
    """`data` as `path`, all or nothing. A full or failing file system raises StorageError (errors.py) naming
    `what` and `path`, with the temporary file removed and the old `path`, if any, untouched."""
    path = os.fspath(path)
    tmp = tmp_name(path)
    with storage_guard(path, what, cleanup=lambda: unlink_quietly(tmp)):
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def atomic_write_text(path: str | os.PathLike, text: str, what: str = "file") -> None:
    atomic_write_bytes(path, text.encode("utf-8"), what)


def atomic_write_json(path: str | os.PathLike, record: object, what: str = "file") -> None:
    atomic_write_text(path, json.dumps(record, indent=1, sort_keys=True) + "\n", what)


def unlink_quietly(path: str | os.PathLike) -> None:
    """Remove a temporary file if it is there (a failed write may or may not have created it)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        pass   # an I/O error removing it too: it stays a tmp name, which no reader lists


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
