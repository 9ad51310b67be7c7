"""Children that die with the process that started them: `die_with_parent(pid)` in the child (a `preexec_fn`, or a
multiprocessing initializer) asks the kernel for SIGKILL when its parent dies (Linux `PR_SET_PDEATHSIG`). Used where
a SIGKILLed parent would otherwise leave its helpers running under init: a Slurm proctrack plugin that finds a
step's processes by parentage (proctrack/linuxproc) never ends those. The trainer's checkpoint-writer manager
(trainer/orphans.py) and the rollout keeper's ranks and name server (rollout/keeper.py) take it."""
from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """In a child: SIGKILL when process `parent` dies, and exit now if it has died already (between the fork and
    this call, the child's parent became init)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):   # not Linux: the child outlives a killed parent, as without this
        return
    if os.getppid() != parent:
        os._exit(1)
