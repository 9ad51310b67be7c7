"""What /proc says of a process, read without psutil (the tests' stop handling runs before anything is imported)."""
from __future__ import annotations

import os
from pathlib import Path


def environ(pid: int) -> dict[str, str]:
    """The environment process `pid` started with; {} once it is gone or not ours to read."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def alive(pid: int) -> bool:
    """The process exists (a zombie not yet reaped included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def running(pid: int) -> bool:
    """Alive, not a zombie waiting for its reaper (a container's init may be slow to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
