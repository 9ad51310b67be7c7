"""The one logging set-up of every rstar-hpc process: a fixed prefix naming the role and the rank (or node).

    init_logging("trainer", rank, rank0_only=True)   # 2026-11-24 10:00:00,123 trainer[3] INFO rstar_hpc.trainer: ...
    init_logging("rollout", rank)                    # every rank logs: engine ranks report their own events
    init_logging("sandbox", node)                    # one service per node: the node names it

Its first line says which install runs (`rstar-hpc 0.1.0 from /site/venv/.../rstar_hpc, python ...`): on a cluster
with a site install, a user's venv and container images, that is the first thing to know about a job.

Which ranks print is decided here, once: with `rank0_only` the other ranks log warnings and errors only (data-
parallel ranks would repeat rank 0's lines). Output goes to stderr; stdout stays free for a command's results.
Stdlib only: the sandbox service's entry calls it too.
"""
from __future__ import annotations

import logging
import os
import sys


def init_logging(role: str, rank: int | str | None = None, *, rank0_only: bool = False) -> None:
    """Configure the root logger for this process (a no-op if it already has handlers, like basicConfig)."""
    where = f"{role}[{rank}]" if rank is not None else role
    quiet = rank0_only and rank not in (None, 0, "0")
    first = not logging.getLogger().handlers
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO,
                        format=f"%(asctime)s {where} %(levelname)s %(name)s: %(message)s")
    if first and not quiet:
        from rstar_hpc import __version__

        logging.getLogger("rstar_hpc").info("rstar-hpc %s from %s, python %s (%s)", __version__,
                                            os.path.dirname(os.path.abspath(__file__)), sys.version.split()[0],
                                            sys.executable)
