"""What /proc says of a process, read without psutil (the tests' stop handling runs before anything is imported)."""
from __future__ import annotations

from pathlib import Path


def environ(pid: int) -> dict[str, str]:
    """The environment process `pid` started with; {} once it is gone or not ours to read."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
