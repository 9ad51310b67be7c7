"""A tracker run's identity: the same for every job of a role in a run directory, so a requeue resumes it."""
from __future__ import annotations

import hashlib

from rstar_hpc.exchange.rundir import RunPaths


def run_id(paths: RunPaths, role: str) -> str:
    """16 hex digits of the run directory and the role (W&B ids: letters and digits; MLflow: a tag)."""
    return hashlib.sha256(f"{paths.dir.absolute()}\0{role}".encode()).hexdigest()[:16]


def flat_params(tree: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys -> strings (MLflow params are flat strings; W&B takes the tree itself)."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, f"{name}."))
        else:
            out[name] = str(value)[:500]   # MLflow servers before 2.x refuse longer values
    return out
