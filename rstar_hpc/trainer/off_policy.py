"""The off-policy correction: which tokens of a step another policy version generated, and their truncated
importance weights against the policy the trainer holds (docs/performance.md, "Overlap mode").

A token is corrected by fact, not by setting: its recorded policy version (the engines record it per token) against
the trainer's. `staleness_mask` drops tokens too far behind (trainer.max_token_staleness); `recompute_old_logprobs`
takes the trainer's own logprobs as pi_old and gives the others' tokens (every token with algo.tis.scope: all)
min(pi_old / pi_behaviour, tis_cap), and measures the engine-trainer mismatch on the trainer's own tokens.
"""
from __future__ import annotations

import numpy as np
import torch

from rstar_hpc.trainer.parallel import from_last_stage
from rstar_hpc.trainer.step import MicroBatch, forward_logprobs


def staleness_mask(mask: np.ndarray, behind: np.ndarray, bound: int) -> tuple[np.ndarray, int]:
    """The loss mask without the model tokens generated more than `bound` policy versions before the trainer's
    (trainer.max_token_staleness: masked, not weighted), and how many it removed."""
    drop = (behind > bound) & (mask != 0)
    if not drop.any():
        return mask, 0
    return np.where(drop, 0, mask).astype(mask.dtype), int(drop.sum())


@torch.no_grad()
def recompute_old_logprobs(model, micro_batches: list[MicroBatch], tis_cap: float | None = None,
                           temperature: float = 1.0, scope: str = "stale") -> dict[str, float]:
    """Replace each micro-batch's old_logprobs (the engine's) with the trainer's at the rollout's sampling
    `temperature`, before the update, on the last pipeline stage (where the loss runs); returns the gap between
    the two over trained tokens (engine minus trainer: numerics, stale weights), the same on every rank.

    Tokens another policy version generated (extras["stale"]) need a correction. With `tis_cap`
    (algo.loss.tis_cap) they get the truncated importance weight min(pi_old / pi_behaviour, tis_cap) in
    extras["is_weight"] (the trainer's own tokens get 1), and the ratio's statistics before truncation are
    returned; without it they keep the engine's logprob as pi_old, so the clipped ratio is taken against it.
    `scope` (algo.tis.scope) "all" weights every trained token so, the trainer's own too.

    The mismatch: mean and max |log p_engine - log p_trainer| over the trained tokens the trainer's own version
    generated (train/logprob_mismatch_*), where the two should agree but for numerics."""
    acc: dict[str, torch.Tensor] = {}   # on the device, read once below

    def add(key: str, value: torch.Tensor, op=torch.add) -> None:
        acc[key] = value if key not in acc else op(acc[key], value)

    for mb, mine in zip(micro_batches, forward_logprobs(model, micro_batches, temperature) or []):
        mine = mine.float()
        mask, behaviour = mb.loss_mask.to(mine.device), mb.old_logprobs.to(mine.device)
        d = torch.where(mask, behaviour - mine, 0.0)
        add("abs", d.abs().sum(dtype=torch.float64))
        add("signed", d.sum(dtype=torch.float64))
        add("count", mask.sum(dtype=torch.float64))
        add("max_abs", d.abs().max(), torch.maximum)
        stale = mb.extras.get("stale", torch.zeros(mb.num_tokens)).to(mine.device).bool()
        own = torch.where(mask & ~stale, d.abs(), 0.0)
        add("own_abs", own.sum(dtype=torch.float64))
        add("own", (mask & ~stale).sum(dtype=torch.float64))
        add("own_max", own.max(), torch.maximum)
        if tis_cap is None:
            mb.old_logprobs = torch.where(stale, behaviour, mine)
            continue
        mb.old_logprobs = mine
        corrected = mask if scope == "all" else mask & stale
        ratio = torch.where(corrected, mine - behaviour, 0.0).clamp(max=20.0).exp()
        mb.extras["is_weight"] = ratio.clamp(max=tis_cap)
        add("ratio", torch.where(corrected, ratio, 0.0).sum(dtype=torch.float64))
        add("truncated", (corrected & (ratio > tis_cap)).sum(dtype=torch.float64))
        add("weighted", corrected.sum(dtype=torch.float64))
        add("r_max", torch.where(corrected, ratio, 0.0).max(), torch.maximum)
        add("r_min", torch.where(corrected, ratio, float("inf")).min(), torch.minimum)
    acc = dict(zip(acc, torch.stack([v.to(torch.float64) for v in acc.values()]).tolist())) if acc else {}
    abs_sum, signed_sum, count, max_abs, own_abs, own, own_max = (acc.get(k, 0.0) for k in (
        "abs", "signed", "count", "max_abs", "own_abs", "own", "own_max"))
    r_sum, truncated, weighted, r_max, r_min = (acc.get(k, d) for k, d in (
        ("ratio", 0.0), ("truncated", 0.0), ("weighted", 0.0), ("r_max", 0.0), ("r_min", float("inf"))))
    sums = from_last_stage({"abs": abs_sum, "signed": signed_sum, "count": count, "ratio": r_sum,
                            "truncated": truncated, "weighted": weighted, "own_abs": own_abs, "own": own})
    maxes = from_last_stage({"gap": max_abs, "own": own_max}, op="max")
    c = max(sums["count"], 1.0)
    out = {"train/old_logprob_gap_abs_mean": sums["abs"] / c, "train/old_logprob_gap_mean": sums["signed"] / c,
           "train/old_logprob_gap_abs_max": maxes["gap"]}
    if sums["own"]:   # a step of other versions' tokens only has no mismatch to measure
        out.update({"train/logprob_mismatch_mean": sums["own_abs"] / sums["own"],
                    "train/logprob_mismatch_max": maxes["own"]})
    if sums["weighted"]:   # over the weighted tokens; a step of the trainer's own tokens logs none
        w = sums["weighted"]
        out.update({"train/is_weighted_fraction": w / c, "train/is_ratio_mean": sums["ratio"] / w,
                    "train/is_truncated_fraction": sums["truncated"] / w,
                    "train/is_ratio_max": from_last_stage({"max": r_max}, op="max")["max"],
                    "train/is_ratio_min": -from_last_stage({"max": -r_min}, op="max")["max"]})
    return out
