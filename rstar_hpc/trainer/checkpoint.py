"""Checkpoints of the trainer: megatron-core distributed checkpointing with an atomic commit.

What a checkpoint holds: the model (sharded by Megatron's own sharded_state_dict, so it reloads under another
tensor-parallel size), AdamW moments (sharded the same way), the schedule, the step, the data cursor, and every
rank's RNG states. Resuming from it reproduces the losses of an uninterrupted run.

Commit protocol: `rstar_hpc.exchange.checkpoints.CommittedDirs` (owned by the exchange): rank 0 opens a fresh
temporary directory, every rank writes its shards into it, then rank 0 writes COMMITTED.json, renames the
directory to `step-XXXXXXXX` and only then moves `latest`. A save killed at any point leaves `latest` on the
previous complete checkpoint; the unfinished directory is never read and is pruned by retention.

Saves on request: `SaveOnSignal` turns SIGUSR2 (Slurm's `--signal=USR2@120` before the time limit) into a flag
the loop checks after each step; all ranks agree on it before saving (any rank's flag counts).
"""
from __future__ import annotations

import contextlib
import os
import random
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map, optim_state_to_sharding_state

from rstar_hpc.exchange.checkpoints import CommittedDirs

FORMAT = "rstar-hpc-trainer-v1"
# test hook: die (as a SIGKILL would) after this step's shards are written and before the commit
DIE_IN_SAVE_ENV = "RSTAR_HPC_TEST_DIE_IN_SAVE_AT_STEP"


@dataclass
class TrainState:
    """Everything a resume needs. `data_state` is the data loader's `state_dict()` (its cursor)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    step: int = 0
    data_state: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def _host_only_cuda_calls():
    """megatron-core 0.16's torch_dist save path calls torch.cuda.synchronize() after staging tensors and puts
    its failure flag on torch.cuda.current_device(), even for CPU tensors under gloo. On a torch without CUDA,
    route exactly those two calls to the host for the duration of a save/load; with CUDA this does nothing."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device, torch.cuda.synchronize = (lambda: "cpu"), (lambda device=None: None)
    try:
        yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


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


def _init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its AdamW state tensors, so a fresh optimizer has something to load into."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state[p]
            if not st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _params_in_order(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _sharded_state_dict(state: TrainState, *, loading: bool, with_optimizer: bool = True) -> dict:
    model_sd = state.model.sharded_state_dict()
    sd: dict[str, Any] = {"model": model_sd, "format": FORMAT, "step": state.step,
                          "scheduler": state.scheduler.state_dict() if state.scheduler is not None else None,
                          "data": state.data_state}
    rank, world = _rank(), (torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1)
    # every rank's generators differ (tp ranks, dp ranks): one shard per rank, no replicas
    sd["rng"] = ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)
    if with_optimizer:
        if loading:
            _init_adam_state(state.optimizer)
        opt = state.optimizer.state_dict()
        steps = {float(s["step"]) for s in opt["state"].values() if "step" in s}
        id_map = get_param_id_to_sharded_param_map(model_sd, _params_in_order(state.optimizer))
        optim_state_to_sharding_state(opt, id_map, exclude_keys=("step",))
        # AdamW counts steps per parameter; they are all equal, so one number is kept
        opt["adam_step"] = max(steps) if steps else 0.0
        sd["optimizer"] = opt
    return sd


def save_checkpoint(state: TrainState, root: str | os.PathLike, *, keep_last: int | None = None,
                    **meta: Any) -> Path:
    """Save `state` as `<root>/step-<state.step>` and move `<root>/latest` to it. Collective: every rank calls.

    `root` is the stage's checkpoint folder (`RunPaths.ckpt_root(stage)`). `keep_last` prunes older complete
    checkpoints (never the one `latest` names). Returns the committed directory.
    """
    dirs = CommittedDirs(root, prefix="step")
    holder: list[Any] = [str(dirs.begin(state.step)) if _rank() == 0 else None]
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(holder, src=0)  # every rank writes into rank 0's fresh dir
    tmp = Path(holder[0])
    with _host_only_cuda_calls():
        dist_checkpointing.save(_sharded_state_dict(state, loading=False), str(tmp))
    _barrier()
    if os.environ.get(DIE_IN_SAVE_ENV) == str(state.step):
        os._exit(137)
    final = dirs.path(state.step)
    if _rank() == 0:
        final = dirs.commit(state.step, tmp, format=FORMAT,
                            tensor_parallel_size=parallel_state.get_tensor_model_parallel_world_size(), **meta)
        if keep_last:
            dirs.retain(keep_last)
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
    sd = _sharded_state_dict(state, loading=True, with_optimizer=not reset_optimizer)
    with _host_only_cuda_calls():
        loaded = dist_checkpointing.load(sd, str(path))
    state.model.load_state_dict(loaded["model"], strict=False)
    state.step = int(loaded["step"])
    state.data_state = loaded["data"]
    _set_rng_state(loaded["rng"])
    if not reset_optimizer:
        opt = loaded["optimizer"]
        step = opt.pop("adam_step")
        for s in opt["state"].values():
            s["step"] = torch.tensor(step)
        # param ids are positions; the groups' own lists were not saved (LocalNonpersistentObject)
        fresh = state.optimizer.state_dict()
        for g_saved, g_fresh in zip(opt["param_groups"], fresh["param_groups"]):
            g_saved["params"] = g_fresh["params"]
        state.optimizer.load_state_dict(opt)
        if state.scheduler is not None and loaded["scheduler"] is not None:
            state.scheduler.load_state_dict(loaded["scheduler"])
    return state


class SaveOnSignal:
    """SIGUSR2 (or `sig`) sets a flag; `should_save()` is true on every rank once any rank got it."""

    def __init__(self, sig: int = signal.SIGUSR2):
        self.requested = False
        self._previous = signal.signal(sig, self._handle)
        self._sig = sig

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def should_save(self) -> bool:
        device = "cuda" if torch.cuda.is_available() else "cpu"  # NCCL reduces CUDA tensors only
        flag = torch.tensor(float(self.requested), device=device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def clear(self) -> None:
        self.requested = False

    def close(self) -> None:
        signal.signal(self._sig, self._previous)
