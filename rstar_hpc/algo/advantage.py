"""Group-normalised advantages over the kept rollouts (paper §2.2.1, Eq. 6; verl compute_grpo_outcome_advantage).

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)      std: unbiased (n - 1), as torch.std in the public code
    A_i = r_i - mean_g(r)                          with norm_adv_by_std = False (Dr. GRPO style)

The mean and std are taken over the rollouts RoC kept (G per group), not the 2G sampled: pass the kept ones.
Every token of a trajectory gets its A_i (`tokens_per_sample` broadcasts it over a packed token stream).
Decision: a group of one rollout gets A = 0 (no baseline, so no signal); verl uses mean 0, std 1 there,
i.e. A = r, a baseline-free REINFORCE term that would sit among group-relative ones.
"""
from __future__ import annotations

import numpy as np
import torch
from numpy.typing import ArrayLike

from rstar_hpc.algo._config import resolve
from rstar_hpc.config.algo import LossConfig


def group_advantages(rewards: ArrayLike, group_ids: ArrayLike, cfg: LossConfig | None = None, *,
                     eps: float = 1e-6, **kwargs) -> np.ndarray:
    """One advantage per trajectory (float64), grouping by `group_ids` (any sortable ids, any order)."""
    cfg = resolve(LossConfig, cfg, kwargs)
    r = np.asarray(rewards, dtype=np.float64)
    ids = np.asarray(group_ids)
    if r.ndim != 1 or ids.shape != r.shape:
        raise ValueError(f"rewards {r.shape} and group_ids {ids.shape} must be 1-D and of equal length")
    if not np.isfinite(r).all():
        raise ValueError("rewards hold NaN or inf")
    _, g = np.unique(ids, return_inverse=True)
    g = g.reshape(-1)
    n = np.bincount(g).astype(np.float64)
    mean = np.bincount(g, weights=r) / n
    dev = r - mean[g]
    adv = np.where(n[g] > 1, dev, 0.0)
    if cfg.norm_adv_by_std:
        std = np.sqrt(np.bincount(g, weights=dev * dev) / np.maximum(n - 1, 1))
        adv = adv / (std[g] + eps)
    return adv


def tokens_per_sample(values: ArrayLike | torch.Tensor, seqlens: ArrayLike | torch.Tensor) -> torch.Tensor:
    """Broadcast one value per sample to its tokens in a packed stream: `seqlens[i]` tokens of `values[i]`.
    (From cu_seqlens, pass `cu_seqlens.diff()`.)"""
    v, n = torch.as_tensor(values), torch.as_tensor(seqlens, dtype=torch.long)
    if v.shape != n.shape or v.dim() != 1:
        raise ValueError(f"values {tuple(v.shape)} and seqlens {tuple(n.shape)} must be 1-D and of equal length")
    return torch.repeat_interleave(v, n)
