"""The trainer's parallel world and the policy as megatron-core trains it in it: the process group and megatron's
model-parallel groups, model chunks of this rank's pipeline stage(s), wrapped in megatron's DistributedDataParallel,
and megatron's optimizer over them.

    init_distributed(tp, pp, backend, vpp=...)          # process groups (destroy_distributed at the end)
    policy = build_policy(arch, cfg.trainer, backend)   # chunks of this rank, DDP-wrapped
    load_hf_checkpoint(policy, hf_dir)                  # hf_convert.py: this rank's shard of every chunk
    optimizer = build_optimizer(policy, cfg.trainer, lr)

Layout: ranks = tp x pp x dp. Each rank holds `virtual_pipeline_parallel_size` chunks (one without virtual
stages) of its pipeline stage, each chunk a `GPTModel` with the first stage's embedding and the last stage's
final norm and output layer. Gradients live in DDP's contiguous buffers (`param.main_grad`, fp32 with
`grad_reduce_in_fp32`); `finalize_model_grads` (called by the schedule) reduces them over data-parallel ranks,
sums the replicated QK-norm gradients over tensor-parallel ranks and scales by the step's trained tokens.
The optimizer is megatron's: fp32 main weights for bf16 parameters, and with `use_distributed_optimizer` its
state and main weights sharded over data-parallel ranks (reduce-scatter of gradients, all-gather of weights).
On the `cpu` backend all of this runs on gloo inside `host_device.on_host()`.

Every group, the world's and each of megatron's (tensor, pipeline, data parallel, their gloo twins), fails a
collective that waits longer than trainer.collective_timeout_s; `naming_failed_collectives` turns gloo's
"Timed out waiting 600000ms for recv operation" into an error that names the group it happened in.
"""
from __future__ import annotations

import datetime
import json
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME
from megatron.core.optimizer import OptimizerConfig, clip_grads, get_megatron_optimizer
from megatron.core.utils import local_multi_tensor_l2_norm

from rstar_hpc.trainer import host_device
from rstar_hpc.trainer.arch import Arch
from rstar_hpc.trainer.logprobs import output_weight
from rstar_hpc.trainer.model import Backend, Recompute, build_model
from rstar_hpc.trainer.parallel_dims import ParallelDims


# --------------------------------------------------------------------------------------------------
# the parallel world


def init_distributed(tp: int = 1, pp: int = 1, backend: Backend = "cpu", seed: int = 0,
                     vpp: int | None = None, timeout_s: float | None = None, ep: int = 1) -> ParallelDims:
    """Join the process group (env:// from torchrun, or SLURM_* under srun) and build Megatron's groups.

    Idempotent within a process: a second call checks the degrees and returns. `timeout_s`: a collective that waits
    longer fails (trainer.collective_timeout_s), in the world and in every megatron group; None: torch's default for
    the world, megatron's (30 min) for its groups.
    """
    import os
    import socket

    if not torch.distributed.is_initialized():
        env = os.environ
        rank = int(env.get("RANK", env.get("SLURM_PROCID", 0)))
        world = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", 1)))
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        if world == 1 and "MASTER_PORT" not in env:   # a world of one: any free port, so two never meet
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                env["MASTER_PORT"] = str(s.getsockname()[1])
        env.setdefault("MASTER_PORT", "29533")
        # torch's flight recorder keeps each rank's last collectives with their group's name, which is how
        # `naming_failed_collectives` tells where a failed one waited (a value you set stands; 0: off)
        env.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))
        if backend == "cuda":
            # every rank sees its node's GPUs (NCCL's P2P/NVLink between them) and computes on its local rank's
            # (launch/binding.py records the same choice); one visible GPU: that one
            local = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", 0)))
            torch.cuda.set_device(local % torch.cuda.device_count())
        # NCCL reduces CUDA tensors only; gloo in the same group serves the CPU ones (a flag, a checkpoint's
        # metadata), so neither side has to move a tensor to suit the other
        timeout = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
        torch.distributed.init_process_group("cpu:gloo,cuda:nccl" if backend == "cuda" else "gloo", rank=rank,
                                             world_size=world, **timeout)
    dims = ParallelDims(world_size=torch.distributed.get_world_size(), tp=tp, pp=pp, vpp=vpp, ep=ep)
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_virtual_pipeline_model_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size())
        if have != (tp, pp, vpp, ep):
            raise RuntimeError(f"model parallel groups already built with (tp, pp, vpp, ep)={have}, asked for "
                               f"{(tp, pp, vpp, ep)}")
        return dims
    # megatron gives its groups `timedelta(minutes=distributed_timeout_minutes)`: a fraction keeps the seconds exact
    # (no rounding to whole minutes). It builds one group without it (EXPERT_DATA_PARALLEL_GROUP_GLOO, 30 min), so
    # every group of this rank is set again after, as megatron's own update_pg_timeout does.
    minutes = {"distributed_timeout_minutes": timeout_s / 60} if timeout_s else {}
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp,
                                             expert_model_parallel_size=ep, **minutes)
    if timeout_s:
        timeout = datetime.timedelta(seconds=timeout_s)
        for group in getattr(parallel_state, "_global_process_group_list", None) or []:
            if group is not None:   # None: the world, which has it from init_process_group
                torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)
    torch.manual_seed(seed)
    if backend == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:   # sequence parallelism's embedding enters the tracker's model-parallel state; on the host its states are
        # empty and setting one does nothing (host_device)
        tracker = tensor_parallel.get_cuda_rng_tracker()
        tracker.set_states({**tracker.get_states(), _MODEL_PARALLEL_RNG_TRACKER_NAME: torch.empty(0)})
    return dims


def collective_device() -> str:
    """Where a small tensor for a collective lives: CUDA where the group runs NCCL, else the CPU (gloo)."""
    if torch.distributed.is_initialized() and "nccl" in str(torch.distributed.get_backend()):
        return "cuda"
    return "cpu"


FLIGHT_RECORDER_ENTRIES = 256


class CollectiveError(RuntimeError):
    """A collective of the trainer's world failed (timed out on a hung peer, or lost a dead one); the message names
    the operation and its process group (megatron's names: TENSOR_MODEL_PARALLEL_GROUP, DATA_PARALLEL_GROUP, ...)."""


def last_collective() -> str | None:
    """The collective this thread entered last, as 'gloo:all_reduce on TENSOR_MODEL_PARALLEL_GROUP (timeout 600 s)',
    from torch's flight recorder; None where it is off (TORCH_FR_BUFFER_SIZE=0) or saw none. Right after a
    collective of this thread failed, it is that one: a rank enters its next collective only once the last returned.
    (The recorder marks a failed gloo collective finished, like a completed one, once its work is gone, so "the last
    entered" is what it can tell.)"""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        entries = json.loads(_dump_fr_trace_json(includeCollectives=True)).get("entries", [])
    except Exception:   # a torch without it, a recorder that is off
        return None
    mine = [e for e in entries if str(e.get("thread_id")) == str(threading.get_ident())]
    if not mine:
        return None
    e = max(mine, key=lambda e: (e.get("time_created_ns", 0), e.get("record_id", 0)))
    uid, desc = (list(e.get("process_group") or []) + ["", ""])[:2]
    timeout = f" (timeout {e['timeout_ms'] / 1000:g} s)" if e.get("timeout_ms") else ""
    return f"{e.get('profiling_name') or 'a collective'} on {desc or f'process group {uid}'}{timeout}"


@contextmanager
def naming_failed_collectives() -> Iterator[None]:
    """Re-raise a collective's failure as a CollectiveError naming the collective and its group: gloo says only
    "Timed out waiting 600000ms for recv operation to complete" (or "Connection closed by peer"), not which of
    megatron's groups. Other errors, and a failure the flight recorder has no collective for, pass unchanged. (On
    NCCL the watchdog ends the process itself, logging the group.)"""
    try:
        yield
    except RuntimeError as e:
        collective = isinstance(e, torch.distributed.DistError) or "gloo" in str(e)
        where = last_collective() if collective and not isinstance(e, CollectiveError) else None
        if where is None:
            raise
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else "?"
        raise CollectiveError(f"{where} failed on rank {rank}: a peer is hung or dead (a wait longer than "
                              f"trainer.collective_timeout_s fails): {type(e).__name__}: {e}") from e


def destroy_distributed(keep_world: bool = False) -> None:
    """Megatron's model-parallel groups, and (unless `keep_world`) the process group itself."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized() and not keep_world:
        torch.distributed.destroy_process_group()



# --------------------------------------------------------------------------------------------------
# the policy


class Policy(torch.nn.Module):
    """This rank's model chunks (DDP-wrapped), in virtual-stage order; `arch` is the whole model's."""

    def __init__(self, chunks: list[DistributedDataParallel], arch: Arch, length_multiple: int = 1):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)
        self.arch = arch
        self.length_multiple = length_multiple   # packed micro-batches are padded to a multiple of this

    @property
    def config(self):
        return self.chunks[0].config

    def modules_with_offsets(self) -> list[tuple[torch.nn.Module, int]]:
        """(GPTModel chunk, global index of its first layer) for each chunk."""
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        return [(c.module, get_transformer_layer_offset(c.module.config, c.module.vp_stage)) for c in self.chunks]

    def single_module(self) -> torch.nn.Module:
        """The whole model as one GPTModel (no pipeline parallelism), for direct forward calls."""
        if len(self.chunks) != 1 or parallel_state.get_pipeline_model_parallel_world_size() != 1:
            raise ValueError("this policy is split over pipeline stages; run it through step.py's schedule")
        return self.chunks[0].module

    def zero_grad_buffers(self) -> None:
        """Zero DDP's gradient buffers and drop `.grad`: megatron's fp32 optimizer points `.grad` at `main_grad`,
        and a `.grad` left from the last step would be added into the buffer a second time."""
        for c in self.chunks:
            c.zero_grad_buffer()
        for p in self.parameters():
            p.grad = None

    def sharded_state_dict(self) -> dict:
        """Megatron's sharded state of every chunk: layer tensors carry global layer indices, so a checkpoint
        loads under another tensor/pipeline/virtual layout."""
        return {f"chunk{i}": c.module.sharded_state_dict() for i, c in enumerate(self.chunks)}

    def load_sharded(self, loaded: dict) -> None:
        for i, c in enumerate(self.chunks):
            c.module.load_state_dict(loaded[f"chunk{i}"], strict=False)


def build_policy(arch: Arch, trainer, backend: Backend, *, seed: int = 0) -> Policy:
    """This rank's chunks for the `trainer` config section (degrees from the initialised process groups)."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    recompute = Recompute(trainer.recompute, tuple(trainer.recompute_modules), trainer.recompute_num_layers)
    knobs = cuda_knobs(trainer, backend, moe=arch.is_moe)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=trainer.grad_reduce_in_fp32,
                                               use_distributed_optimizer=trainer.use_distributed_optimizer,
                                               overlap_grad_reduce=knobs["overlap_grad_reduce"])
    chunks = []
    with host_device.on_host():
        for v in range(vpp or 1):
            model = build_model(arch, backend=backend, params_dtype=getattr(torch, trainer.params_dtype), seed=seed,
                                vp_stage=v if vpp else None, recompute=recompute,
                                logprob_chunk=trainer.logprob_chunk_tokens,
                                sequence_parallel=knobs["sequence_parallel"],
                                gradient_accumulation_fusion=knobs["gradient_accumulation_fusion"])
            # one bucket per chunk after the first, as Megatron-LM does (their grads finish at different times)
            chunks.append(DistributedDataParallel(model.config, ddp_config, model, disable_bucketing=v > 0))
            if model.post_process:   # the fused loss writes this weight's gradient into main_grad (logprobs.py)
                output_weight(model).overlap_grad_reduce = ddp_config.overlap_grad_reduce
    for c in chunks:
        c.config.finalize_model_grads_func = finalize_model_grads
        c.config.no_sync_func = [x.no_sync for x in chunks] if len(chunks) > 1 else chunks[0].no_sync
    multiple = trainer.packed_length_multiple or (256 if backend == "cuda" else 1)
    if knobs["sequence_parallel"]:   # the packed row is split over the tensor-parallel ranks
        multiple = math.lcm(multiple, parallel_state.get_tensor_model_parallel_world_size())
    return Policy(chunks, arch, multiple)


def cuda_knobs(trainer, backend: Backend, moe: bool = False) -> dict[str, bool]:
    """`trainer.sequence_parallel`, `overlap_grad_reduce` and `gradient_accumulation_fusion`, their nulls
    resolved for this backend and layout (initialised process groups); fused accumulation asked for without Apex's
    extension is an error naming it (sequence parallelism at tp 1 is refused by the config itself). A `moe` model
    at tp > 1 trains with sequence parallelism on either backend: megatron's MoE layer refuses to train without."""
    cuda = backend == "cuda"
    tp = parallel_state.get_tensor_model_parallel_world_size()
    dp = parallel_state.get_data_parallel_world_size()
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401  (Apex's extension, what megatron's layers call)
        fusable = cuda
    except ImportError:
        fusable = False
    if trainer.gradient_accumulation_fusion and not fusable:
        raise RuntimeError("trainer.gradient_accumulation_fusion=true needs CUDA and Apex's fused_weight_gradient_"
                           "mlp_cuda extension (pip install apex with --cpp_ext --cuda_ext, or a NGC PyTorch image); "
                           "set it to null or false")

    def pick(value, default: bool) -> bool:
        return default if value is None else bool(value)
    if moe and tp > 1 and trainer.sequence_parallel is False:
        raise ValueError("trainer.sequence_parallel=false with tensor_parallel_size > 1: megatron's MoE layer does "
                         "not train without sequence parallelism; set it to null or true")
    return {"sequence_parallel": pick(trainer.sequence_parallel, (cuda or moe) and tp > 1),
            "overlap_grad_reduce": pick(trainer.overlap_grad_reduce, cuda and dp > 1),
            "gradient_accumulation_fusion": pick(trainer.gradient_accumulation_fusion, fusable)}


def _l2_norm_on_device(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """The gradient norm for megatron's clipping without Apex or Transformer Engine: megatron's own fallback
    (`local_multi_tensor_l2_norm`) builds `torch.tensor` from the per-tensor norms, a device-to-host copy per
    parameter tensor (~390 syncs a step at qwen3-4b's shape on an H200); this one stays on the device."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


if clip_grads.l2_norm_impl is local_multi_tensor_l2_norm:
    clip_grads.l2_norm_impl = _l2_norm_on_device


def build_optimizer(policy: Policy, trainer, lr: float):
    """Megatron's AdamW for the `trainer` section: decay on matrices only, clipping at `optimizer.grad_clip`,
    fp32 main weights with bf16 parameters, sharded over data-parallel ranks with `use_distributed_optimizer`.
    Build it after loading the weights: it copies them into its fp32 main weights."""
    opt = trainer.optimizer
    config = OptimizerConfig(optimizer="adam", lr=lr, min_lr=0.0, weight_decay=opt.weight_decay,
                             adam_beta1=opt.betas[0], adam_beta2=opt.betas[1], adam_eps=1e-8,
                             clip_grad=opt.grad_clip, bf16=trainer.params_dtype == "bfloat16",
                             params_dtype=getattr(torch, trainer.params_dtype),
                             use_distributed_optimizer=trainer.use_distributed_optimizer)
    with host_device.on_host():
        optimizer = get_megatron_optimizer(config, list(policy.chunks))
    for g in optimizer.param_groups:  # megatron leaves wd_mult (0 on norms) to its own lr scheduler
        g["weight_decay"] = opt.weight_decay * g.get("wd_mult", 1.0)
    return optimizer


# --------------------------------------------------------------------------------------------------
# reductions the step's metrics need


def dp_sum(values: list[float]) -> list[float]:
    """Sums over data-parallel ranks (float64)."""
    t = torch.tensor(values, dtype=torch.float64, device=collective_device())
    if parallel_state.get_data_parallel_world_size() > 1:
        torch.distributed.all_reduce(t, group=parallel_state.get_data_parallel_group())
    return t.tolist()


def from_last_stage(values: dict[str, float | torch.Tensor], op: str = "sum") -> dict[str, float]:
    """Per-rank metric values that only the last pipeline stage has (its loss function's): reduced over
    data-parallel ranks (`sum` or `max`) there, then sent to every stage. Values may be 0-dim device tensors:
    they are read together, one device-to-host copy."""
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True) and values:
        dev = collective_device()
        t = torch.stack([torch.as_tensor(v, device=dev).detach().to(torch.float64).reshape(())
                         for v in values.values()])
        if parallel_state.get_data_parallel_world_size() > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM if op == "sum" else
                                         torch.distributed.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
        values = dict(zip(values, t.tolist()))
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        box = [values]
        torch.distributed.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                                group=parallel_state.get_pipeline_model_parallel_group())
        values = box[0]
    return values
