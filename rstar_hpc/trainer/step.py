"""One optimizer step over packed micro-batches: the seam between data (SFT, RL shards) and the model.

A `MicroBatch` is one row of concatenated samples (THD packing) with per-token fields aligned to tokens:
`loss_mask[i]` says token i is trained; `logprobs[i] = log p(token i | earlier tokens of its sample)`, so the
first token of each sample never has a logprob (its mask must be 0). RL adds `advantages` and `old_logprobs`
(the engine's or recomputed) with the same alignment; the loss function decides what to do with them.

Normalisation is global: every loss function returns a SUM over its tokens, and `train_step` divides by the
number of trained tokens in the whole step across all micro-batches and data-parallel ranks before backward,
then sums gradients over data-parallel ranks. That is the token-level mean of the paper, independent of how
samples were packed or spread over ranks.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from megatron.core import parallel_state

from rstar_hpc.trainer.model import forward_logits, packed_seq_params, token_logprobs


@dataclass
class MicroBatch:
    input_ids: torch.Tensor                        # [T] long, samples concatenated
    seqlens: list[int]                             # sample lengths, sum = T
    loss_mask: torch.Tensor                        # [T] bool: token i is trained
    advantages: torch.Tensor | None = None         # [T] float (RL)
    old_logprobs: torch.Tensor | None = None       # [T] float (RL)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        t = self.input_ids.numel()
        if sum(self.seqlens) != t:
            raise ValueError(f"seqlens sum to {sum(self.seqlens)} but the micro-batch has {t} tokens")
        for name in ("loss_mask", "advantages", "old_logprobs"):
            v = getattr(self, name)
            if v is not None and v.shape != (t,):
                raise ValueError(f"{name} has shape {tuple(v.shape)}, expected ({t},) aligned with input_ids")
        starts = torch.tensor([0] + list(self.seqlens[:-1])).cumsum(0)
        if self.loss_mask[starts].any():
            raise ValueError("loss_mask is set on the first token of a sample, which has no prediction; "
                             "mask prompts (at least their first token) out")

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device: torch.device | str) -> MicroBatch:
        move = lambda x: None if x is None else x.to(device)
        return MicroBatch(move(self.input_ids), self.seqlens, move(self.loss_mask), move(self.advantages),
                          move(self.old_logprobs), {k: move(v) for k, v in self.extras.items()})


def pack(samples: Iterable[tuple[torch.Tensor, torch.Tensor]], token_budget: int,
         **per_token: Iterable[torch.Tensor]) -> list[MicroBatch]:
    """Greedy first-fit packing of (input_ids, loss_mask) samples into micro-batches of <= token_budget tokens.

    `per_token` names optional aligned lists (`advantages=[...]`, `old_logprobs=[...]`). Order is kept within
    a micro-batch; a sample longer than the budget is an error (raise the budget or truncate upstream).
    """
    samples = list(samples)
    extra = {k: list(v) for k, v in per_token.items()}
    bins: list[list[int]] = []
    used: list[int] = []
    for i, (ids, _) in enumerate(samples):
        n = ids.numel()
        if n > token_budget:
            raise ValueError(f"sample {i} has {n} tokens, more than trainer.micro_batch_tokens={token_budget}")
        for b, u in enumerate(used):
            if u + n <= token_budget:
                bins[b].append(i)
                used[b] += n
                break
        else:
            bins.append([i])
            used.append(n)
    out = []
    for b in bins:
        fields = {k: torch.cat([v[i] for i in b]) for k, v in extra.items()}
        out.append(MicroBatch(input_ids=torch.cat([samples[i][0] for i in b]),
                              seqlens=[samples[i][0].numel() for i in b],
                              loss_mask=torch.cat([samples[i][1] for i in b]).bool(),
                              advantages=fields.pop("advantages", None),
                              old_logprobs=fields.pop("old_logprobs", None), extras=fields))
    return out


def sequence_logprobs(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """Token-aligned log-probabilities [T] of `mb` under `model` (0 at sample starts)."""
    ids = mb.input_ids
    logits = forward_logits(model, ids[None], packed_seq_params(mb.seqlens, ids.device))
    nxt = torch.roll(ids, -1)  # position j predicts token j+1; the wrap-around and cross-sample ones are unused
    lp = token_logprobs(logits, nxt[None], model.arch.vocab_size)[0]  # type: ignore[attr-defined]
    out = torch.zeros_like(lp)
    out[1:] = lp[:-1]
    starts = torch.tensor([0] + list(mb.seqlens[:-1]), device=ids.device).cumsum(0)
    out[starts] = 0.0
    return out


class LossFn(Protocol):
    def __call__(self, logprobs: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Return (SUM of the per-token loss over this micro-batch, metric sums to add up over the step)."""


def sft_loss(logprobs: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the trained tokens (summed)."""
    nll = -(logprobs * mb.loss_mask).sum()
    return nll, {"nll_sum": float(nll.detach())}


# --------------------------------------------------------------------------------------------------
# optimizer and schedule


def build_optimizer(model: torch.nn.Module, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                    weight_decay: float = 0.01, eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW; norms (1-d tensors) are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps)


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


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                    schedule: str = "constant", min_lr_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(warmup_steps, total_steps, schedule,
                                                                  min_lr_ratio))


# --------------------------------------------------------------------------------------------------
# the step


def _is_tp_duplicate(p: torch.nn.Parameter) -> bool:
    """Replicated over tensor-parallel ranks (norms): count it once in the gradient norm."""
    return not getattr(p, "tensor_model_parallel", False) and parallel_state.get_tensor_model_parallel_rank() != 0


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Global L2 norm over tensor-parallel shards (replicas counted once); scales grads down to max_norm."""
    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    for p in params:
        if p.grad is not None and not _is_tp_duplicate(p):
            sq += p.grad.detach().float().pow(2).sum()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(sq, group=parallel_state.get_tensor_model_parallel_group())
    norm = float(sq.sqrt())
    if math.isfinite(norm) and norm > max_norm:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm


def _sum_qk_norm_grads_over_tp(model: torch.nn.Module) -> None:
    """QK-norm weights are replicated but each tensor-parallel rank only normalises its own heads, so each
    holds a partial gradient (Megatron-LM's finalize_model_grads does the same sum)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    group = parallel_state.get_tensor_model_parallel_group()
    for name, p in model.named_parameters():
        if p.grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
            torch.distributed.all_reduce(p.grad, group=group)


def _dp_sum(x: torch.Tensor) -> torch.Tensor:
    if parallel_state.get_data_parallel_world_size() > 1:
        torch.distributed.all_reduce(x, group=parallel_state.get_data_parallel_group())
    return x


def forward_backward(model: torch.nn.Module, micro_batches: list[MicroBatch],
                     loss_fn: LossFn = sft_loss) -> dict[str, float]:
    """Accumulate gradients of the step's token-mean loss (data-parallel sum included); no optimizer."""
    device = next(model.parameters()).device
    n_local = sum(int(mb.loss_mask.sum()) for mb in micro_batches)
    denom = _dp_sum(torch.tensor(float(n_local), device=device)).clamp(min=1.0)
    loss_sum = torch.zeros((), device=device)
    sums: dict[str, float] = {}
    for mb in micro_batches:
        mb = mb.to(device)
        loss, metrics = loss_fn(sequence_logprobs(model, mb), mb)
        (loss / denom).backward()
        loss_sum += loss.detach()
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v
    _sum_qk_norm_grads_over_tp(model)
    if parallel_state.get_data_parallel_world_size() > 1:
        for p in model.parameters():  # each rank holds a partial sum of the global token mean
            if p.grad is not None:
                _dp_sum(p.grad)
    return {"loss": float(_dp_sum(loss_sum) / denom), "num_tokens": float(denom),
            **{k: v / float(denom) for k, v in sums.items()}}


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler | None, micro_batches: list[MicroBatch],
               loss_fn: LossFn = sft_loss, grad_clip: float = 1.0) -> dict[str, float]:
    """Forward/backward every micro-batch, clip, step the optimizer and schedule. Returns the step's metrics.

    `loss` is the token-mean of `loss_fn` over the step (all micro-batches, all data-parallel ranks);
    metrics other than loss are this rank's sums over the global token count.
    """
    t0 = time.perf_counter()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    metrics = forward_backward(model, micro_batches, loss_fn)
    t1 = time.perf_counter()
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = clip_grad_norm(params, grad_clip)
    lr = optimizer.param_groups[0]["lr"]
    if math.isfinite(grad_norm):  # a non-finite step is skipped, not applied
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    t2 = time.perf_counter()
    tokens = sum(mb.num_tokens for mb in micro_batches)
    return {**metrics, "grad_norm": grad_norm, "lr": lr, "tokens_per_s": tokens / (t2 - t0), "step_time_s": t2 - t0,
            "time/forward_backward(s)": t1 - t0, "time/optimizer(s)": t2 - t1}
