"""A real, tiny file system that fills up: a tmpfs mounted for one test, and a ballast file that eats its space.

Writes into it fail with a real ENOSPC from the kernel (no mocking), and freeing the ballast makes room again.
Mounting needs root (CI and the dev machine run tests as root); elsewhere the tests that need it are skipped.
"""
from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_fs(folder: Path, size: str = "4m"):
    """A tmpfs of `size` mounted on `folder` (made here), unmounted afterwards."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs on {folder}: {r.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path, leave: int = 0) -> Path:
    """Write a ballast file in `folder` until its file system is full, then give back `leave` bytes."""
    ballast = folder / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        chunk = 1 << 20
        while chunk >= 1:   # unbuffered, ever smaller writes: up to the last free byte
            try:
                os.write(fd, b"\0" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                chunk //= 2
    finally:
        os.close(fd)
    os.truncate(ballast, max(0, os.stat(ballast).st_size - leave))
    return ballast
