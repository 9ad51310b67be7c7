"""The training loop's checkpoint saves, synchronous or async (`trainer.checkpoint.async_save`).

Async saves are megatron-core's async dist-checkpoint save. `save()` plans the save, writes the common part, copies
the rank's shards to host memory and forks a writer (megatron's AsyncCallsQueue) and returns; the loop trains on.
`finalize()` (each step, non-blocking; collective) runs, once the write has finished on every rank, megatron's
finalize functions (the shards' metadata) and then checkpoint.py's commit (COMMITTED.json, the rename, `latest`,
retention), then the caller's `on_commit` (the data ack) with the data cursor the checkpoint holds, not the loop's
current one. A new save first waits for the previous one. A crash or kill before that commit leaves `latest` on
the previous complete checkpoint; `close(abort=True)` (a failure) ends the writer without committing.
"""
from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

from rstar_hpc.exchange.checkpoints import CommittedDirs
from rstar_hpc.trainer import host_device
from rstar_hpc.trainer.checkpoint import TrainState, _begin, _commit, _sharded_state_dict, latest_checkpoint, save_checkpoint
from rstar_hpc.trainer.orphans import results_queue_dies_with_trainer

# test hook, async saves: die right after this step's save was scheduled, its writer still running (no commit)
DIE_IN_ASYNC_WRITE_ENV = "RSTAR_HPC_TEST_DIE_IN_ASYNC_WRITE_AT_STEP"
log = logging.getLogger(__name__)


@dataclass
class _Pending:
    """An async save scheduled and not yet committed."""

    step: int
    tmp: Path
    meta: dict
    data_state: dict   # the data cursor the checkpoint holds (the loop's moves on)
    started: float
    final: Path | None = None


class Checkpointer:
    """One stage's checkpoint saves, synchronous or async (see the module docstring). Collective: every rank makes
    the same calls in the same order.

        ckpt = Checkpointer(root, async_save=True, keep_last=3, on_commit=lambda path, data_state: ...)
        ckpt.save(state, stage="rl")   # sync: committed on return; async: scheduled, returns None
        ckpt.finalize()                # after each step: commits finished saves (blocking=True: waits for them)
        ckpt.close(abort=False)        # the end: waits for and commits a pending save; abort=True: drops it

    `on_commit(path, data_state)` runs on every rank after each commit, with the data cursor saved in it.
    `async_seconds` lists, per save committed since it was last read, its seconds from `save()` to the commit.
    """

    def __init__(self, root: str | os.PathLike, *, async_save: bool = False, keep_last: int | None = None,
                 on_commit: Callable[[Path, dict], None] | None = None):
        self.root, self.dirs = Path(root), CommittedDirs(root, prefix="step")
        self.async_save, self.keep_last, self.on_commit = async_save, keep_last, on_commit
        self._queue = AsyncCallsQueue() if async_save else None
        self._pending: list[_Pending] = []
        self.async_seconds: list[float] = []

    @property
    def pending_step(self) -> int | None:
        """The step of a save scheduled and not committed yet."""
        return self._pending[-1].step if self._pending else None

    def save(self, state: TrainState, **meta: Any) -> Path | None:
        """Save `state` as `step-<state.step>`; sync: returns the committed directory, async: None (`finalize`
        commits it)."""
        if not self.async_save:
            final = save_checkpoint(state, self.root, keep_last=self.keep_last, **meta)
            if self.on_commit is not None:
                self.on_commit(final, state.data_state)
            return final
        self.finalize(blocking=True)   # one save in flight at a time
        results_queue_dies_with_trainer()   # megatron's writer helpers must not outlive a killed trainer (orphans.py)
        t0 = time.perf_counter()
        tmp = _begin(self.dirs, state.step)
        with host_device.on_host(), self.dirs.guard(tmp, "checkpoint"):
            # plans the save over all ranks and writes the common part now; the shards go in the returned request
            request = dist_checkpointing.save(_sharded_state_dict(state, loading=False), str(tmp),
                                              async_sharded_save=True)
            pending = _Pending(state.step, tmp, meta, copy.deepcopy(state.data_state), t0)
            request.add_finalize_fn(lambda: self._commit_pending(pending))
            # copies the shards to host memory (a no-op on the host: the fork's copy-on-write is the snapshot) and
            # forks the writer; training may change the tensors from here on
            self._queue.schedule_async_request(request)
        self._pending.append(pending)
        if os.environ.get(DIE_IN_ASYNC_WRITE_ENV) == str(state.step):
            os._exit(137)
        return None

    def finalize(self, blocking: bool = False) -> list[Path]:
        """Commit the async saves whose write has finished on every rank (`blocking`: wait for all of them);
        returns the committed directories. Collective whenever a save is pending (every rank has the same ones)."""
        if not self._pending:
            return []
        head = self._pending[0]
        try:
            with host_device.on_host(), self.dirs.guard(head.tmp, "checkpoint"):
                self._queue.maybe_finalize_async_calls(blocking=blocking)
        except BaseException:
            self._pending.pop(0)   # its writer has ended (megatron dequeued it); the directory is never committed
            raise
        done = [p for p in self._pending if p.final is not None]
        self._pending = [p for p in self._pending if p.final is None]
        for p in done:
            self.async_seconds.append(time.perf_counter() - p.started)
            if self.on_commit is not None:
                self.on_commit(p.final, p.data_state)
        return [p.final for p in done]

    def _commit_pending(self, p: _Pending) -> None:
        # megatron's own finalize functions ran first: every rank's shards and the metadata are written
        p.final = _commit(self.dirs, p.step, p.tmp, self.keep_last, p.meta)

    def close(self, abort: bool = False) -> None:
        """Wait for and commit a pending save; `abort`: end its writer without committing (a failure: the peers
        may not reach the commit's collectives). `latest` stays on the previous checkpoint then."""
        if self._queue is None:
            return
        if abort:
            for p in self._pending:
                log.warning("checkpoint step %d was not committed (a failure before its write finished); resuming "
                            "starts from %s", p.step, latest_checkpoint(self.root) or "the stage's start")
            for call in self._queue.async_calls:
                call.async_caller.close(abort=True)
            self._queue.async_calls.clear()
            self._pending = []
        else:
            self.finalize(blocking=True)
