"""Checkpoints of the trainer: megatron-core distributed checkpointing with an atomic commit.

What a checkpoint holds: the model (sharded by Megatron's own sharded_state_dict: layer tensors carry global
layer indices), the optimizer's state (megatron's `fully_sharded_model_space` format: AdamW moments and fp32 main
weights per parameter, in model space), the schedule, the step, the data cursor, and every rank's RNG states.
Resuming under the same layout reproduces the losses of an uninterrupted run. A checkpoint also loads under
another layout (tensor, pipeline, virtual-pipeline or data-parallel sizes, distributed optimizer on or off):
megatron's dist-checkpointing reshards the model and optimizer tensors; the RNG states, one per rank, are then
left as they are (logged).

Commit protocol: `rstar_hpc.exchange.checkpoints.CommittedDirs` (owned by the exchange): rank 0 opens a fresh
temporary directory, every rank writes its shards into it, then rank 0 writes COMMITTED.json, renames the
directory to `step-XXXXXXXX` and only then moves `latest`. A save killed at any point leaves `latest` on the
previous complete checkpoint; the unfinished directory is never read and is pruned by retention.

The training loop's saves (`Checkpointer`), synchronous or async (`trainer.checkpoint.async_save`): async saves are
megatron-core's async dist-checkpoint save. `save()` plans the save, writes the common part, copies the rank's shards
to host memory and forks a writer (megatron's AsyncCallsQueue) and returns; the loop trains on. `finalize()` (each
step, non-blocking; collective) runs, once the write has finished on every rank, megatron's finalize functions (the
shards' metadata) and then the commit (COMMITTED.json, the rename, `latest`, retention), then the caller's
`on_commit` (the data ack) with the data cursor the checkpoint holds, not the loop's current one. A new save first
waits for the previous one. A crash or kill before that commit leaves `latest` on the previous complete checkpoint;
`close(abort=True)` (a failure) ends the writer without committing.

Saves on request: `SaveOnSignal` turns SIGUSR2 (Slurm's `--signal=USR2@120` before the time limit) into a flag
the loop checks after each step; all ranks agree on it before saving (any rank's flag counts).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, dict_list_map_outplace
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.optimizer import DistributedOptimizer

from rstar_hpc.exchange.checkpoints import CommittedDirs
from rstar_hpc.exchange.errors import ExchangeError, StorageError
from rstar_hpc.trainer import host_device
from rstar_hpc.trainer.parallel import collective_device
from rstar_hpc.trainer.orphans import results_queue_dies_with_trainer

FORMAT = "rstar-hpc-trainer-v2"  # v1: torch AdamW state, tensor parallelism only
OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}  # reshardable in tp, pp, dp
MAIN_WEIGHTS = ("optimizer.state.param.", "optimizer.state.fp32_param.")  # distributed, plain bf16
# test hook: die (as a SIGKILL would) after this step's shards are written and before the commit
DIE_IN_SAVE_ENV = "RSTAR_HPC_TEST_DIE_IN_SAVE_AT_STEP"
log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Everything a resume needs: the `parallel.Policy`, its megatron optimizer and `step.LRSchedule`.
    `data_state` is the data loader's `state_dict()` (its cursor)."""

    model: Any
    optimizer: Any
    scheduler: Any
    step: int = 0
    data_state: dict[str, Any] = field(default_factory=dict)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def raise_on_every_rank(failed: StorageError | None, what: str) -> None:
    """Collective: raise `failed` where it happened and an ExchangeError pointing at it on every other rank, so no
    rank is left alone in the next barrier when one rank's write hit a full or failing file system."""
    flag = torch.tensor([float(failed is not None)], device=collective_device())
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    if failed is not None:
        raise failed
    if flag.item():
        raise ExchangeError(f"another trainer rank could not write {what} (its log names the path and the free "
                            f"space); free space and run the trainer again: it resumes from the last commit")


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
        from megatron.core import tensor_parallel

        state["megatron_cuda"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_cuda"])


def _init_adam_state(optimizer) -> None:
    """Give every parameter of a fresh megatron optimizer its AdamW state (step 0, zero moments), as a loaded
    one has: the distributed optimizer's state dict needs a step to describe what it will load into (its own
    helper for this takes a dummy step, which would also apply weight decay to the weights)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                          exp_avg_sq=torch.zeros_like(p))


def _main_weights_as_saved(sd: dict, saved: set[str], path: Path) -> None:
    """Point the optimizer's fp32 main weights at the name the checkpoint holds them under: the distributed
    optimizer saves them as `optimizer.state.param.*`, megatron's plain bf16 optimizer as
    `optimizer.state.fp32_param.*`; AdamW moments have one name in all. So `use_distributed_optimizer` may change
    between save and resume, except from the plain fp32 optimizer to the distributed one: the former saves no main
    weights (they are the model's) and the latter cannot read them from the model's tensors."""
    def rename(x):
        if not isinstance(x, (ShardedTensor, ShardedTensorFactory)) or x.key in saved:
            return x
        for prefix in MAIN_WEIGHTS:
            if x.key.startswith(prefix):
                for key in (p + x.key[len(prefix):] for p in MAIN_WEIGHTS):
                    if key in saved:
                        return replace(x, key=key)
                raise ValueError(f"{path} was saved by the plain fp32 optimizer (no fp32 main weights), which the "
                                 f"distributed optimizer cannot resume; resume it with "
                                 f"trainer.use_distributed_optimizer=false, or start a stage with reset_optimizer")
        return x
    dict_list_map_inplace(rename, sd)


def _optimizer_kind(optimizer) -> str:
    return "distributed" if any(isinstance(o, DistributedOptimizer) for o in optimizer.chained_optimizers) else "plain"


def _adam_step(optimizer) -> float:
    """AdamW's step count (the same for every parameter; 0 before the first update)."""
    steps = [float(st["step"]) for o in optimizer.chained_optimizers for st in o.optimizer.state.values() if "step" in st]
    return max(steps, default=0.0)


def _set_adam_step(opt: dict, kind: str, step: float) -> None:
    """Where each optimizer kind keeps its step in its state dict: the plain one as `state.common_step`, the
    distributed one in its param groups."""
    if kind == "plain":
        opt["state"]["common_step"] = torch.tensor(step)
    else:
        for group in opt["optimizer"]["param_groups"]:
            group["step"] = step


def _skeleton(request: Any) -> Any:
    """The optimizer request's own non-tensor values (param groups, formats) with its tensors marked."""
    return dict_list_map_outplace(lambda x: ShardedBase if isinstance(x, ShardedBase) else x, request)


def _as_requested(skeleton: Any, loaded: Any) -> Any:
    """`loaded`'s tensors in the structure of `skeleton`: a checkpoint of the other optimizer kind holds param
    groups and format fields of another shape, which the loading optimizer would not understand."""
    if isinstance(skeleton, dict):
        return {k: _as_requested(v, loaded.get(k) if isinstance(loaded, dict) else None) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [_as_requested(v, loaded[i] if isinstance(loaded, list) and i < len(loaded) else None)
                for i, v in enumerate(skeleton)]
    if isinstance(skeleton, LocalNonpersistentObject):
        return skeleton.unwrap()
    return loaded if skeleton is ShardedBase else skeleton


@contextlib.contextmanager
def _torch_adam_step_kept(optimizer):
    """Two slips of megatron-core 0.16's distributed optimizer loading a `fully_reshardable` state into torch's
    AdamW (no TE or Apex installed, as on the `cpu` backend): it copies every per-parameter state key from the
    checkpoint tensors, `step` included, which it keeps apart (a KeyError: hide `step` from that copy), and it gives
    every parameter the same `step` tensor, which AdamW then increments once per parameter (give each its own)."""
    patched = []
    for o in optimizer.chained_optimizers:
        if isinstance(o, DistributedOptimizer):
            def setter(model_param, tensors, o=o, original=o._set_main_param_and_optimizer_states):
                group_index, group_order = o.model_param_group_index_map[model_param]
                st = o.optimizer.state[o.optimizer.param_groups[group_index]["params"][group_order]]
                step = st.pop("step", None)
                try:
                    original(model_param, tensors)
                finally:
                    if step is not None:
                        st["step"] = step
            o._set_main_param_and_optimizer_states = setter
            patched.append(o)
    try:
        yield
    finally:
        for o in patched:
            del o._set_main_param_and_optimizer_states
            for st in o.optimizer.state.values():
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"] = st["step"].clone()


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _sharded_state_dict(state: TrainState, *, loading: bool, with_optimizer: bool = True,
                        with_rng: bool = True) -> dict:
    model_sd = state.model.sharded_state_dict()
    sd: dict[str, Any] = {"model": model_sd, "format": FORMAT, "step": state.step, "world_size": _world(),
                          "optimizer_kind": _optimizer_kind(state.optimizer), "adam_step": _adam_step(state.optimizer),
                          "scheduler": state.scheduler.state_dict() if state.scheduler is not None else None,
                          "data": state.data_state}
    if with_rng:  # every rank's generators differ (tp, pp, dp ranks): one shard per rank, no replicas
        sd["rng"] = ShardedObject("rng_state", _rng_state(), (_world(),), (_rank(),), replica_id=0)
    if with_optimizer:
        if loading:
            _init_adam_state(state.optimizer)
        sd["optimizer"] = state.optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=OPTIMIZER_FORMAT)
    return sd


def save_checkpoint(state: TrainState, root: str | os.PathLike, *, keep_last: int | None = None,
                    **meta: Any) -> Path:
    """Save `state` as `<root>/step-<state.step>` and move `<root>/latest` to it. Collective: every rank calls.

    `root` is the stage's checkpoint folder (`RunPaths.ckpt_root(stage)`). `keep_last` prunes older complete
    checkpoints (never the one `latest` names). Returns the committed directory.
    """
    dirs = CommittedDirs(root, prefix="step")
    tmp = _begin(dirs, state.step)
    # a full or failing file system: StorageError (path, free space) on every rank (torch's distributed checkpoint
    # gathers each rank's write failure), with the half-written directory removed; `latest` stays where it was
    results_queue_dies_with_trainer()   # megatron's writer helpers must not outlive a killed trainer (orphans.py)
    with host_device.on_host(), dirs.guard(tmp, "checkpoint"):
        dist_checkpointing.save(_sharded_state_dict(state, loading=False), str(tmp))
    return _commit(dirs, state.step, tmp, keep_last, meta)


def _begin(dirs: CommittedDirs, step: int) -> Path:
    """Rank 0's fresh in-progress directory, on every rank. Collective."""
    holder: list[Any] = [str(dirs.begin(step)) if _rank() == 0 else None]
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(holder, src=0)  # every rank writes into rank 0's fresh dir
    return Path(holder[0])


def _commit(dirs: CommittedDirs, step: int, tmp: Path, keep_last: int | None, meta: dict) -> Path:
    """Every rank's shards are in `tmp`: rank 0 seals it as `step`, moves `latest`, prunes. Collective."""
    _barrier()
    if os.environ.get(DIE_IN_SAVE_ENV) == str(step):
        os._exit(137)
    final, failed = dirs.path(step), None
    if _rank() == 0:
        try:
            final = dirs.commit(
                step, tmp, format=FORMAT, world_size=_world(),
                tensor_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
                pipeline_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
                virtual_pipeline_parallel_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
                **meta)
        except StorageError as e:
            failed = e
        if keep_last and failed is None:
            dirs.retain(keep_last)
    raise_on_every_rank(failed, f"the commit of checkpoint {final}")
    _barrier()
    return final


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `root`, or None (an unfinished save is never returned)."""
    found = CommittedDirs(root, prefix="step").latest()
    return found[1] if found else None


def load_checkpoint(state: TrainState, path: str | os.PathLike, *, reset_optimizer: bool = False) -> TrainState:
    """Restore `state` in place from a complete checkpoint directory, or from the latest one under a root.

    `reset_optimizer`: keep the weights and data cursor but start AdamW and the schedule afresh (the
    paper's stage boundary). Collective: every rank calls.
    """
    path = Path(path)
    if not (path / "COMMITTED.json").is_file():
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"{path}: neither a committed checkpoint (no COMMITTED.json) nor a folder "
                                    f"holding one; start without resuming, or point at ckpt/<stage>/ of a run "
                                    f"that saved")
        path = found
    common = dist_checkpointing.load_common_state_dict(str(path))
    if common.get("format") != FORMAT:
        raise ValueError(f"{path}: format {common.get('format')!r}, expected {FORMAT!r}; not a trainer checkpoint")
    same_world = common.get("world_size") == _world()
    if not same_world:
        log.info("%s was saved by %s ranks, this job has %s: weights and optimizer are resharded, RNG states are "
                 "not restored", path, common.get("world_size"), _world())
    saved = set(dist_checkpointing.load_tensors_metadata(str(path)))
    if not reset_optimizer and not any(k.startswith("optimizer.state.exp_avg") for k in saved):
        # every step so far was empty (RoC kept nothing), so AdamW never stepped and saved no moments: fresh
        # moments are the same thing
        log.info("%s holds no AdamW moments (the optimizer has not stepped yet); AdamW starts with zero moments", path)
        reset_optimizer = True
    sd = _sharded_state_dict(state, loading=True, with_optimizer=not reset_optimizer, with_rng=same_world)
    other_kind = common.get("optimizer_kind") != _optimizer_kind(state.optimizer)
    if not reset_optimizer:
        _main_weights_as_saved(sd["optimizer"], saved, path)
        skeleton = _skeleton(sd["optimizer"]) if other_kind else None
    with host_device.on_host():
        loaded = dist_checkpointing.load(sd, str(path))
        state.model.load_sharded(loaded["model"])
        if reset_optimizer:  # the optimizer's fp32 main weights are copies: take the loaded weights
            state.optimizer.reload_model_params()
        else:
            opt = loaded["optimizer"]
            if other_kind:
                opt = _as_requested(skeleton, opt)
                _set_adam_step(opt, _optimizer_kind(state.optimizer), float(loaded["adam_step"]))
            with _torch_adam_step_kept(state.optimizer):
                state.optimizer.load_state_dict(opt)
    state.step = int(loaded["step"])
    state.data_state = loaded["data"]
    if same_world:
        _set_rng_state(loaded["rng"])
    if not reset_optimizer and state.scheduler is not None and loaded["scheduler"] is not None:
        state.scheduler.load_state_dict(loaded["scheduler"])
    return state


# ------------------------------------------------------------------------------------------------ the loop's saves
# test hook, async saves: die right after this step's save was scheduled, its writer still running (no commit)
DIE_IN_ASYNC_WRITE_ENV = "RSTAR_HPC_TEST_DIE_IN_ASYNC_WRITE_AT_STEP"


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


class SaveOnSignal:
    """SIGUSR2 (Slurm's pre-timeout signal) or SIGTERM (preemption's grace period, `scancel --signal=TERM`, a
    requeue) sets a flag; `should_save()` is true on every rank once any rank got one."""

    def __init__(self, sigs: tuple[int, ...] = (signal.SIGUSR2, signal.SIGTERM)):
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in sigs}

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def should_save(self) -> bool:
        flag = torch.tensor(float(self.requested), device=collective_device())
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def clear(self) -> None:
        self.requested = False

    def close(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
