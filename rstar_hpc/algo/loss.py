"""The GRPO-RoC policy loss (paper §2.2.1, Eq. 6-7), per token t of kept trajectory i:

    rho   = exp(clamp(logp - logp_old, -log_ratio_clamp, log_ratio_clamp))
    l_t   = max(-A_i * rho, -A_i * clip(rho, 1 - clip_ratio_low, 1 + clip_ratio_high))      Clip-Higher
    l_t   = min(l_t, -A_i * clip_ratio_c)   where A_i < 0, if clip_ratio_c is set             dual-clip (verl)
    l_t  *= w_t                             if is_weight is given (another policy's tokens: truncated IS, tis_cap)
    l_t  += kl_coef * (exp(ref - logp) - (ref - logp) - 1)                                    k3 KL, off by default
    l_t  -= entropy_coef * H_t                                                                off by default
    L     = dp_world_size * sum_{masked t} l_t / global_num_tokens

`global_num_tokens` is the number of loss-mask tokens in the whole mini-batch, over all micro-batches and
data-parallel ranks: the paper's 1/sum|o_i|. Summing the gradients of every micro-batch's L then gives exactly
the gradient of the global token mean, however samples were packed or split (verl instead takes a token
mean per micro-batch and rescales by sequence counts, which is only approximately this). Pass
`dp_world_size` when the data-parallel backend averages gradients over ranks (DDP, FSDP); leave it at 1
when it sums them. With `global_num_tokens=None` the loss is the plain sum over tokens, for a caller that
divides itself (rstar_hpc.trainer.step's LossFn contract).

Masking: tokens with loss_mask 0 (tool responses, chat wrappers, prompt, padding) contribute neither loss nor
gradient, even if their log-probs are -inf or NaN. Any shape works, as long as the per-token tensors agree:
a packed stream [T] (advantages broadcast with `tokens_per_sample`) or a padded batch [B, T] (advantages
[B, T] or [B, 1]).
"""
from __future__ import annotations

from typing import TypedDict

import torch

from rstar_hpc.algo._config import resolve
from rstar_hpc.config.algo import LossConfig


class LossStats(TypedDict):
    """Sums over the masked tokens of one call, so micro-batches and ranks add up exactly; divide by the
    global token count (`metrics.loss_metrics`) for means and fractions. Each is a 0-dim float64 tensor on the
    loss's device: a trainer adds them up over its micro-batches and reads them once a step (no device-to-host
    copy per micro-batch)."""

    num_tokens: torch.Tensor
    pg_loss_sum: torch.Tensor
    clip_low_count: torch.Tensor
    """A < 0 and rho < 1 - clip_ratio_low: clipped, no gradient."""
    clip_high_count: torch.Tensor
    """A > 0 and rho > 1 + clip_ratio_high: clipped, no gradient."""
    clip_dual_count: torch.Tensor
    """A < 0 and the dual-clip bound is active."""
    approx_kl_sum: torch.Tensor
    """k3 estimate of KL(pi_old || pi): rho - 1 - log rho."""
    kl_sum: torch.Tensor
    entropy_sum: torch.Tensor


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of the softmax over the last dimension."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                loss_mask: torch.Tensor, cfg: LossConfig | None = None, *, global_num_tokens: float | None,
                dp_world_size: int = 1, ref_logprobs: torch.Tensor | None = None,
                entropy: torch.Tensor | None = None, is_weight: torch.Tensor | None = None,
                **kwargs) -> tuple[torch.Tensor, LossStats]:
    """Clipped-surrogate loss of one micro-batch; see the module docstring. `is_weight`: per-token importance
    weights (no gradient), pi_old / pi_behaviour truncated on tokens another policy version made (trainer/rl.py). Returns
    (loss, LossStats)."""
    cfg = resolve(LossConfig, cfg, kwargs)
    shape = logprobs.shape
    for name, t in (("old_logprobs", old_logprobs), ("loss_mask", loss_mask), ("ref_logprobs", ref_logprobs),
                    ("entropy", entropy), ("is_weight", is_weight)):
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but logprobs has {tuple(shape)}; per-token "
                             "tensors must be aligned")
    if global_num_tokens is not None and not global_num_tokens > 0:
        raise ValueError(f"global_num_tokens must be > 0 (loss-mask tokens of the whole mini-batch over all "
                         f"micro-batches and ranks), got {global_num_tokens}")
    mask = loss_mask.bool()
    adv = torch.broadcast_to(advantages, shape).to(logprobs.dtype)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)

    # masked positions are zeroed before exp so that padding garbage cannot turn into NaN gradients
    log_ratio = torch.where(mask, logprobs - old_logprobs, zero).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = log_ratio.exp()
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high))
    dual = torch.zeros_like(mask)
    if cfg.clip_ratio_c is not None:
        dual = (adv < 0) & (pg > -adv * cfg.clip_ratio_c)
        pg = torch.where(dual, -adv * cfg.clip_ratio_c, pg)
    if is_weight is not None:
        pg = pg * torch.where(mask, is_weight.detach().to(pg.dtype), zero)
    per_token = pg
    kl = torch.zeros_like(pg)
    if cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs (reference-policy log-probs); pass them or set kl_coef=0")
        d = torch.where(mask, ref_logprobs - logprobs, zero)
        kl = (d.exp() - d - 1).clamp(-10, 10)
        per_token = per_token + cfg.kl_coef * kl
    if cfg.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy (entropy_from_logits); pass it or set "
                             "entropy_coef=0")
        per_token = per_token - cfg.entropy_coef * torch.where(mask, entropy, zero)

    loss = torch.where(mask, per_token, zero).sum()
    if global_num_tokens is not None:
        loss = loss * (dp_world_size / global_num_tokens)
    with torch.no_grad():
        m = mask

        def total(x: torch.Tensor) -> torch.Tensor:   # where, not x[m]: boolean indexing waits for the device
            return torch.where(m, x, zero).sum(dtype=torch.float64)

        stats = LossStats(
            num_tokens=m.sum(dtype=torch.float64),
            pg_loss_sum=total(pg),
            clip_low_count=(m & (adv < 0) & (ratio < 1 - cfg.clip_ratio_low)).sum(dtype=torch.float64),
            clip_high_count=(m & (adv > 0) & (ratio > 1 + cfg.clip_ratio_high)).sum(dtype=torch.float64),
            clip_dual_count=(m & dual).sum(dtype=torch.float64),
            approx_kl_sum=total(ratio - 1 - log_ratio),
            kl_sum=total(kl),
            entropy_sum=total(entropy) if entropy is not None else zero.new_zeros((), dtype=torch.float64),
        )
    return loss, stats
