"""Retention of trajectory steps: keep the newest `keep`, and never a step some consumer has not acked.

(Checkpoint and policy retention is `CommittedDirs.retain`, which never deletes what `latest` names.)
Run it from one coordinator (the trainer). Deletion failures, e.g. NFS silly-renames of shards a reader still
has memory-mapped, are logged and retried on the next call.
"""
from __future__ import annotations

import logging
import shutil

from rstar_hpc.exchange.reader import consumer_cursors
from rstar_hpc.exchange.rundir import RunPaths

log = logging.getLogger(__name__)


def prune_trajectories(paths: RunPaths, stage: str, keep: int) -> list[int]:
    """Delete consumed step directories beyond the newest `keep`; returns the steps deleted."""
    if keep < 0:
        raise ValueError(f"prune_trajectories(keep={keep}): keep must be >= 0")
    cursors = consumer_cursors(paths, stage)
    if not cursors:
        return []   # nobody consumed anything yet: everything is still needed
    consumed_below = min(cursors.values())
    steps = paths.traj_steps(stage)
    candidates = steps[:-keep] if keep else steps
    removed = []
    for step in candidates:
        if step >= consumed_below:
            break
        try:
            shutil.rmtree(paths.traj_step_dir(stage, step))
            removed.append(step)
        except OSError as e:
            log.warning("could not delete %s (%s); will retry", paths.traj_step_dir(stage, step), e)
    return removed
