"""Children that die with the process that started them: `die_with_parent(pid)` in the child (a `preexec_fn`, or a
multiprocessing initializer) asks the kernel for SIGKILL when its parent dies (Linux `PR_SET_PDEATHSIG`). Used where
a SIGKILLed parent would otherwise leave its helpers running under init: a Slurm proctrack plugin that finds a
step's processes by parentage (proctrack/linuxproc) never ends those. The trainer's checkpoint-writer manager
(trainer/orphans.py) and the rollout keeper's ranks and name server (rollout/keeper.py) take it.

A process whose children start their own (vLLM's engine core spawns its workers; nothing of ours runs in them)
calls `group_dies_with_me()`: a watcher in its process group kills the whole group once it has died, however it
died. So a rollout task SIGKILLed whole (its keeper, then its rank by the death signal) leaves no engine core
holding memory for Slurm to fail to kill."""
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


def group_dies_with_me(poll_s: float = 1.0) -> None:
    """When this process dies, every process left in its process group is SIGKILLed (within `poll_s`): a small
    watcher in the group polls for it. Only for a process that leads its group (the rollout keeper starts each rank
    in a session of its own); elsewhere a no-op, since the group would be its caller's (a shell's)."""
    import subprocess

    me = os.getpid()
    if os.getpgid(0) != me:
        return
    subprocess.Popen(["/bin/sh", "-c", f"while kill -0 {me} 2>/dev/null; do sleep {poll_s:g}; done; kill -KILL -{me}"],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
