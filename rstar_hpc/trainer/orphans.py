"""Helper processes that die with the trainer.

megatron-core's checkpoint writer collects its write results through a spawn-context `Manager().Queue()`
(dist_checkpointing/strategies/filesystem_async.py, created at a rank's first save): a manager server process and,
with it, multiprocessing's resource tracker. Killed with SIGKILL, the trainer leaves both behind, reparented to init:
a Slurm proctrack plugin that finds a step's processes by parentage (proctrack/linuxproc, the emulated cluster's) never
ends them, so they outlive the step, its requeues and the job. `results_queue_dies_with_trainer` creates that queue
first, on a manager whose server asks the kernel for SIGKILL when the trainer dies (PR_SET_PDEATHSIG); the resource
tracker then exits by itself once its last writer (the manager) is gone.
"""
from __future__ import annotations

import multiprocessing
import os
from multiprocessing.managers import SyncManager

from rstar_hpc.parentage import die_with_parent

_managers: list[SyncManager] = []


def results_queue_dies_with_trainer() -> None:
    """Give megatron's checkpoint writer its results queue on a manager that dies with this process (once)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is not None:
        return   # made already (by us or by megatron), or a megatron without it: nothing to do
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(die_with_parent, (os.getpid(),))
    _managers.append(manager)   # keep it (its queue's proxy refers to it too)
    filesystem_async._results_queue = manager.Queue()
