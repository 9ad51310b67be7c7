"""Errors of the exchange; each message names the path involved and what to do about it.

Stdlib only: atomic.py, and through it the sandbox service, imports StorageError and storage_guard from here."""
from __future__ import annotations

import contextlib
import errno
import os
import re


class ExchangeError(RuntimeError):
    """Base class: something in the run directory is not as the protocol requires."""


class CorruptShardError(ExchangeError):
    """A committed shard's size or checksum differs from its commit record (torn write, bit rot, tampering)."""

    def __init__(self, path: str, reason: str):
        self.path = path
        super().__init__(
            f"corrupt trajectory shard {path}: {reason}. The commit record lists a different file; "
            f"delete the step's commit record of that producer and re-run it (or drop the step).")


class StepNotReadyError(ExchangeError, TimeoutError):
    """Not every expected producer committed the step in time."""

    def __init__(self, step_dir: str, step: int, missing: list[str], committed: list[str], waited_s: float):
        self.step, self.missing, self.committed = step, missing, committed
        super().__init__(
            f"step {step} not complete after {waited_s:.1f}s in {step_dir}: missing producers {missing} "
            f"(committed: {committed or 'none'}). Check those rollout ranks' logs and announcements "
            f"(`rstar-hpc run status`).")


# errno values that mean "the storage refused the write", not a bug in the caller: a full file system or quota,
# a device error, a file system remounted read-only after one
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG})


class StorageError(ExchangeError):
    """Shared storage refused a write (full, over quota, I/O error, read-only). Carries the path, the errno and
    the free bytes of the file system at the time (None if even statvfs failed). Whatever the write was, nothing
    of it is visible to readers: the temporary file is gone and the last commit stands."""

    def __init__(self, path: str | os.PathLike, what: str, err: OSError):
        self.path, self.errno, self.what = os.fspath(path), err.errno, what
        self.free_bytes, self.total_bytes = free_space(self.path)
        space = ("free space unknown (statvfs failed)" if self.free_bytes is None else
                 f"{_size(self.free_bytes)} free of {_size(self.total_bytes)} on its file system")
        name = errno.errorcode.get(err.errno, str(err.errno))
        super().__init__(
            f"cannot write {what} {self.path}: {err.strerror or err} ({name}); {space}. Nothing of it is visible to "
            f"readers (the last commit stands). Free space or fix the storage, then run the role again: it resumes "
            f"from its last commit.")


def is_storage_failure(err: BaseException) -> OSError | None:
    """The storage OSError behind `err` (itself, a cause or context, or a failure a checkpointing library
    collected from its writer threads), or None when `err` is something else."""
    seen: set[int] = set()
    todo: list = [err]
    while todo:
        e = todo.pop()
        if e is not None and not isinstance(e, BaseException):
            e = getattr(e, "exception", None)   # torch.distributed.checkpoint wraps each rank's failure
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)   # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += list(failures.values())
        # errors that carry an OSError as text only: megatron's checkpoint writer processes ("Worker failure:
        # [Errno 28] No space left on device"; torch's gather of rank failures drops exception chains) and
        # safetensors' Rust writer ("I/O error: No space left on device (os error 28)")
        text = str(e)
        for m in _ERRNO_TEXT.finditer(text):
            code = int(m.group(1) or m.group(4))
            if code in STORAGE_ERRNOS:
                return OSError(code, (m.group(2) or m.group(3)).strip())
        if _TORCH_SHORT_WRITE.search(text):
            return OSError(errno.ENOSPC, "No space left on device (torch's file writer wrote short and dropped the "
                                         "errno: a full file system or quota)")
    return None


_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^\n:'\"]+)|([^:\n]+) \(os error (\d+)\)")
# torch.save's zip writer on a short write: it records the bytes the OS took, and the next record's offset no longer
# matches ("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"); the ENOSPC itself is lost
_TORCH_SHORT_WRITE = re.compile(r"inline_container\.cc:\d+\].*unexpected pos \d+ vs \d+")


@contextlib.contextmanager
def storage_guard(path: str | os.PathLike, what: str, cleanup=None):
    """Turn a storage failure inside the block into StorageError(path, what), after `cleanup()` (removing the
    temporary file or directory, so a full disk is not kept full by a half-written copy). Other errors pass."""
    try:
        yield
    except StorageError:
        if cleanup is not None:
            cleanup()
        raise
    except BaseException as e:
        found = is_storage_failure(e)
        if found is None:
            raise
        err = StorageError(path, what, found)   # the free space at the failure, before cleanup gives some back
        if cleanup is not None:
            cleanup()
        raise err from e


def free_space(path: str) -> tuple[int | None, int | None]:
    """(free bytes for unprivileged users, total bytes) of the file system holding `path` (or its nearest
    existing parent)."""
    probe = os.path.abspath(path)
    while True:
        try:
            st = os.statvfs(probe)
            return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        except FileNotFoundError:
            parent = os.path.dirname(probe)
            if parent == probe:
                return None, None
            probe = parent
        except OSError:
            return None, None


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
