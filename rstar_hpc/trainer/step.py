"""One optimizer step over a step's micro-batches: the seam between data (SFT, RL shards) and the model.

The step runs megatron-core's schedule (`get_forward_backward_func`: no pipelining, 1F1B, or interleaved 1F1B
with virtual stages) over the `Policy` of `parallel.py`; the loss function runs on the last pipeline stage, on the
token-aligned log-probabilities of each micro-batch (packing.py says what a `MicroBatch` is).

Normalisation is global: every loss function returns a SUM over its tokens and the number of trained tokens;
megatron's `finalize_model_grads` sums gradients over data-parallel ranks and divides them by the trained tokens
of the whole step (all micro-batches, all ranks). That is the token-level mean of the paper, independent of how
samples were packed or spread over ranks. Metrics are made the same on every rank (`parallel.from_last_stage`).
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Protocol

import torch
from megatron.core import parallel_state
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.pipeline_parallel import get_forward_backward_func

from rstar_hpc.trainer import host_device
from rstar_hpc.trainer.flops import model_flops
from rstar_hpc.trainer.logprobs import aligned_logprobs, fused_loss, output_weight, unwrapped
from rstar_hpc.trainer.attention import packed_seq_params
from rstar_hpc.trainer.packing import (  # noqa: F401  (re-exported)
    MicroBatch,
    TokenSlice,
    pack,
    pad_to_length,
    round_up_count,
)
from rstar_hpc.trainer.parallel import Policy, dp_sum, from_last_stage


class LossFn(Protocol):
    def __call__(self, logprobs: torch.Tensor, mb: TokenSlice, entropy: torch.Tensor
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Return (SUM of the per-token loss over these tokens, metric sums to add up over the step: 0-dim
        tensors, read once a step). Called on
        consecutive chunks of a micro-batch's tokens (trainer.logprob_chunk_tokens), so each token's loss must
        depend on its own log-probability only (trainer/logprobs.py). `entropy`: each token's entropy of the
        distribution it is predicted from (0 at sample starts), for metrics: no gradient flows through it."""


def sft_loss(logprobs: torch.Tensor, mb: TokenSlice, entropy: torch.Tensor
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of the trained tokens (summed); their entropy, as train/entropy."""
    nll = -(logprobs * mb.loss_mask).sum()
    return nll, {"nll_sum": nll.detach(), "train/entropy": (entropy * mb.loss_mask).sum()}


# --------------------------------------------------------------------------------------------------
# log-probabilities of a micro-batch


def _run(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """The model (chunk) on one micro-batch: logits on the last stage, hidden states elsewhere."""
    if mb.padded_len is not None:
        return model(input_ids=mb.rows(), position_ids=None, attention_mask=None)
    ids = mb.input_ids
    return model(input_ids=ids[None], position_ids=None, attention_mask=None,
                 packed_seq_params=packed_seq_params(mb.seqlens, ids.device))


def sequence_logprobs(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """Token-aligned log-probabilities [T] of `mb` under a whole model (one GPTModel, or a Policy without
    pipeline parallelism)."""
    if isinstance(model, Policy):
        model = model.single_module()
    return aligned_logprobs(_run(model, mb), output_weight(model), mb, model.arch.vocab_size,  # type: ignore
                            unwrapped(model).logprob_chunk)


# --------------------------------------------------------------------------------------------------
# the schedule


def _loss(mb: MicroBatch, loss_fn: LossFn | None, vocab_size: int, model: torch.nn.Module, temperature: float,
          output: torch.Tensor, non_loss_data=False):
    """The last stage's loss from the policy's output (its last hidden states), chunk by chunk (logprobs.py), at
    `temperature`: logits / T = (hidden / T) @ W^T, so the hidden states are scaled and the chunks stay as they are."""
    weight, chunk = output_weight(model), unwrapped(model).logprob_chunk
    if temperature != 1.0:
        output = output / temperature
    with host_device.paused():
        if non_loss_data or loss_fn is None:
            return aligned_logprobs(output, weight, mb, vocab_size, chunk)
        loss, metrics = fused_loss(output, weight, mb, vocab_size, loss_fn, chunk)
    return loss, mb.loss_mask.sum().to(torch.int), {"loss_sum": loss.detach(), **metrics}


class Progress:
    """Micro-batches this process has run forward (training and the pi_old recompute alike): what the trainer's
    heartbeat watches (trainer/heartbeat.py), so a long step that moves is told from a hung one."""

    def __init__(self):
        self.micro_batches = 0


PROGRESS = Progress()
SLOW_ENV = "RSTAR_HPC_TEST_SLOW_MICRO_BATCH_S"   # test hook: seconds each micro-batch takes at least (a long step)


def _schedule(policy: Policy, micro_batches: list[MicroBatch], loss_fn: LossFn | None, forward_only: bool,
              temperature: float = 1.0) -> tuple[list, int]:
    """Run megatron's schedule over the micro-batches (moved to the model's device); what the last stage's loss
    function returned, per micro-batch (empty elsewhere), and how many micro-batches ran (fillers included).
    Log-probabilities are taken at `temperature`."""
    # padded on the host, then moved: to a multiple of length_multiple (a few shapes for the compiled kernels, and
    # rows that split over the tensor-parallel ranks with sequence parallelism)
    m = policy.length_multiple
    mbs = [pad_to_length(mb, -(-mb.num_tokens // m) * m) for mb in micro_batches]
    if policy.config.virtual_pipeline_model_parallel_size is not None:  # interleaved: fixed shape (model.py),
        longest = max(mb.num_tokens for mb in mbs)                     # count a multiple of pp
        mbs = round_up_count([pad_to_length(mb, longest) for mb in mbs],
                             parallel_state.get_pipeline_model_parallel_world_size(), longest)
    device = next(policy.parameters()).device
    mbs = [mb.to(device) for mb in mbs]
    vocab = policy.arch.vocab_size

    slow = float(os.environ.get(SLOW_ENV, "0") or 0)

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        with host_device.paused():
            output = _run(model, mb)
        if slow:
            time.sleep(slow)
        PROGRESS.micro_batches += 1
        return output, partial(_loss, mb, loss_fn, vocab, model, temperature)

    chunks = list(policy.chunks)
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=[iter(mbs) for _ in chunks] if len(chunks) > 1 else iter(mbs),
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(mbs),
        seq_length=max(mb.num_slots for mb in mbs), micro_batch_size=1, forward_only=forward_only,
        collect_non_loss_data=forward_only), len(mbs)


def _load_balancing_loss(policy: Policy, micro_batches: int) -> dict[str, float]:
    """The MoE router's load-balancing loss of the step (without its coefficient), as megatron's
    `track_moe_metrics` reports it: per layer and micro-batch, averaged over data-parallel ranks; its gradient is
    in the step's already (megatron's `MoEAuxLossAutoScaler`). Every rank calls; empty for a dense model."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
    )

    tracker = get_moe_layer_wise_logging_tracker()
    if not policy.arch.is_moe or "load_balancing_loss" not in tracker:
        return {}
    reduce_aux_losses_tracker_across_ranks(["load_balancing_loss"])
    value = float(tracker["load_balancing_loss"]["values"].sum()) / (policy.arch.num_layers * micro_batches)
    clear_aux_losses_tracker()
    return {"train/moe_load_balancing_loss": value}


def forward_backward(policy: Policy, micro_batches: list[MicroBatch], loss_fn: LossFn = sft_loss,
                     temperature: float = 1.0) -> dict[str, float]:
    """Accumulate gradients of the step's token-mean loss (data-parallel reduction included); no optimizer.
    Gradients are in each parameter's `main_grad` (megatron's grad buffer)."""
    denom = dp_sum([float(sum(mb.num_trained for mb in micro_batches))])[0]
    with host_device.on_host():
        policy.zero_grad_buffers()
        if policy.arch.is_moe:   # what a forward outside a step (a test's) may have left
            from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
            clear_aux_losses_tracker()
        out, ran = _schedule(policy, micro_batches, loss_fn, forward_only=False, temperature=temperature)
        balance = _load_balancing_loss(policy, ran)
    sums: dict = {}
    for reduced in out:   # device tensors: read once, in from_last_stage
        for k, v in reduced.items():
            sums[k] = sums.get(k, 0.0) + v
    sums = from_last_stage(sums)
    d = max(denom, 1.0)
    return {"loss": sums.pop("loss_sum") / d, "num_tokens": denom, **{k: v / d for k, v in sums.items()}, **balance}


@torch.no_grad()
def forward_logprobs(policy: Policy, micro_batches: list[MicroBatch], temperature: float = 1.0
                     ) -> list[torch.Tensor] | None:
    """Token-aligned log-probabilities of each micro-batch on the last pipeline stage (None elsewhere), of the
    distribution at `temperature` (logits / temperature)."""
    policy.eval()
    with host_device.on_host():
        out, _ = _schedule(policy, micro_batches, None, forward_only=True, temperature=temperature)
    policy.train()
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return [lp[: mb.num_tokens] for lp, mb in zip(out, micro_batches)]  # fillers come last


# --------------------------------------------------------------------------------------------------
# optimizer step and schedule


def optimizer_step(optimizer) -> tuple[float, bool]:
    """Clip to the configured norm and step a megatron optimizer; a step whose gradient norm is not finite is
    skipped, not applied. Returns (gradient norm before clipping, applied)."""
    with host_device.on_host():
        found_inf = optimizer.prepare_grads()
        grad_norm = float(optimizer.get_grad_norm())
        if found_inf or not math.isfinite(grad_norm):
            return grad_norm, False
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            params = opt.get_parameters()
            if params and opt.config.clip_grad > 0:
                clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad, total_norm=grad_norm)
        return grad_norm, bool(optimizer.step_with_ready_grads())


def lr_lambda(warmup_steps: int, total_steps: int, schedule: str = "constant",
              min_lr_ratio: float = 0.0) -> Callable[[int], float]:
    """Multiplier of the base lr at a step: linear warm-up, then constant (RL) or cosine to min_lr_ratio (SFT)."""
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"schedule={schedule!r}; use 'constant' or 'cosine'")

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


class LRSchedule:
    """`lr = base_lr x lr_lambda(step)` on every param group of a (megatron) optimizer; `last_epoch` counts
    steps, as torch's schedulers do (they only take torch optimizers)."""

    def __init__(self, optimizer, base_lr: float, fn: Callable[[int], float]):
        self.optimizer, self.base_lr, self.fn, self.last_epoch = optimizer, base_lr, fn, 0
        self._apply()

    def _apply(self) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = self.base_lr * self.fn(self.last_epoch)

    def step(self) -> None:
        self.last_epoch += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch, "base_lr": self.base_lr}

    def load_state_dict(self, state: dict) -> None:
        self.last_epoch, self.base_lr = int(state["last_epoch"]), float(state["base_lr"])
        self._apply()


def build_scheduler(optimizer, warmup_steps: int, total_steps: int, schedule: str = "constant",
                    min_lr_ratio: float = 0.0) -> LRSchedule:
    """The schedule at the optimizer's current lr (the stage's)."""
    return LRSchedule(optimizer, optimizer.param_groups[0]["lr"],
                      lr_lambda(warmup_steps, total_steps, schedule, min_lr_ratio))


# --------------------------------------------------------------------------------------------------
# the step


def train_step(policy: Policy, optimizer, scheduler: LRSchedule | None, micro_batches: list[MicroBatch],
               loss_fn: LossFn = sft_loss, temperature: float = 1.0) -> dict[str, float]:
    """Forward/backward every micro-batch, clip, step the optimizer and schedule. Returns the step's metrics,
    the same on every rank.

    `loss` is the token-mean of `loss_fn` over the step (all micro-batches, all data-parallel ranks), as is
    every metric the loss function returns; `loss_fn` sees log-probabilities at `temperature` (an RL step: the
    rollout's sampling temperature, so they compare with the engines'). `perf/model_flops`: the update's model
    FLOPs on this rank's samples (trainer/flops.py), for perf/mfu."""
    t0 = time.perf_counter()
    policy.train()
    metrics = forward_backward(policy, micro_batches, loss_fn, temperature)
    t1 = time.perf_counter()
    lr = optimizer.param_groups[0]["lr"]
    grad_norm, applied = optimizer_step(optimizer)
    if scheduler is not None:
        scheduler.step()
    t2 = time.perf_counter()
    tokens = sum(mb.num_tokens for mb in micro_batches)
    seqlens = [n for mb in micro_batches for n in mb.seqlens]
    return {**metrics, "grad_norm": grad_norm, "lr": lr, "train/update_skipped": float(not applied),
            "tokens_per_s": tokens / (t2 - t0), "step_time_s": t2 - t0,
            "perf/model_flops": model_flops(policy.arch, seqlens)[0],
            "time/forward_backward(s)": t1 - t0, "time/optimizer(s)": t2 - t1}
