"""Per-step metrics of GRPO-RoC, as flat `group/name(unit)` keys for the step logger.

roc/*       pass rate before and after down-sampling, rollouts sampled and trained per group, groups rejected as all-equal (all correct / all wrong),
            groups dropped as too small, and the mean p_err / p_format / p_total of the positives RoC kept vs
            all positives (the gap is what RoC buys; the paper's Fig. 4 tracks the same quantities).
train/*     clip fractions (low, high, dual), approximate KL to the rollout policy, pg loss, KL and entropy
            terms: token means over the whole step, from the summed LossStats of every micro-batch and rank.
response/*  length statistics (tokens) and the truncated fraction.
behaviour/* what the policy does, over every trajectory the step sampled (before any selection): the tool-error
            ratio (failed calls / calls with a verdict on the code, averaged over the trajectories that made one;
            unlike p_err, no 0.5 for a trajectory without a call), the same over the positives, the share of
            trajectories with a failed call, calls per trajectory, the share with no call, and the pass rates of
            the trajectories with and without a failed call (is an error already punished by the outcome?). The
            paper's tool-error and response-length curves (§3.2) are behaviour/tool_error_ratio and response/*.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np
from numpy.typing import ArrayLike

from rstar_hpc.algo.loss import LossStats
from rstar_hpc.algo.roc import RoCReason, RoCSelection
from rstar_hpc.exchange.columns import TokenColumn
from rstar_hpc.exchange.tool_status import FAILED_TOOL_STATUSES, INFRA_TOOL_STATUSES


def _mean(x: np.ndarray) -> float:
    return float(x.mean()) if x.size else float("nan")


def roc_metrics(selection: RoCSelection, rewards: ArrayLike, p_err: ArrayLike | None = None,
                p_format: ArrayLike | None = None) -> dict[str, float]:
    """Metrics of one `roc_downsample` call (same arrays as its inputs). Means over empty sets are NaN."""
    r = np.asarray(rewards, dtype=np.float64)
    pos, keep, g = r != 0, selection.keep, selection.group
    size, n_pos = np.bincount(g), np.bincount(g, weights=pos)
    group_reason = np.full(size.shape, -1)
    group_reason[g] = selection.reason  # any member's reason tells equal-reward / small-group drops
    trained = np.bincount(g[keep], minlength=size.size)
    out = {
        "roc/num_trajectories": float(r.size), "roc/num_kept": float(keep.sum()), "roc/num_groups": float(size.size),
        # the ablation's fairness: rollouts sampled per prompt, and trained per prompt that trained at all
        "roc/groups_trained": float((trained > 0).sum()),
        "roc/sampled_per_group": _mean(size.astype(float)),
        "roc/trained_per_group": _mean(trained[trained > 0].astype(float)),
        "roc/pass_rate_before": _mean(pos.astype(float)), "roc/pass_rate_after": _mean(pos[keep].astype(float)),
        "roc/groups_all_correct": float((n_pos == size).sum()), "roc/groups_all_wrong": float((n_pos == 0).sum()),
        "roc/groups_rejected_equal": float((group_reason == RoCReason.DROPPED_EQUAL_REWARD).sum()),
        "roc/groups_dropped_small": float((group_reason == RoCReason.DROPPED_SMALL_GROUP).sum()),
        "roc/num_dropped_tool_infra": float((selection.reason == RoCReason.DROPPED_TOOL_INFRA).sum()),
        "roc/penalty_kept_pos": _mean(selection.penalty[pos & keep]),
        "roc/penalty_all_pos": _mean(selection.penalty[pos]),
    }
    for name, x in (("p_err", p_err), ("p_format", p_format)):
        if x is not None:
            x = np.asarray(x, dtype=np.float64)
            out[f"roc/{name}_kept_pos"], out[f"roc/{name}_all_pos"] = _mean(x[pos & keep]), _mean(x[pos])
    return out


def behaviour_metrics(rewards: ArrayLike, statuses: ArrayLike, offsets: ArrayLike) -> dict[str, float]:
    """behaviour/* (module docstring) of one step's sampled trajectories: `rewards` one per trajectory, their tool
    calls' statuses flat in `statuses`, trajectory i's at statuses[offsets[i]:offsets[i + 1]]."""
    r = np.asarray(rewards, dtype=np.float64)
    col = TokenColumn(np.asarray(statuses, dtype=object), np.asarray(offsets, dtype=np.int64))
    if r.size == 0:
        return {}
    infra = np.isin(col.values, sorted(INFRA_TOOL_STATUSES))
    calls = col.lengths()
    judged = col.row_sums(~infra)
    failed = col.row_sums(np.isin(col.values, sorted(FAILED_TOOL_STATUSES)) & ~infra)
    ratio = np.divide(failed, judged, out=np.zeros(r.size), where=judged > 0)
    pos, made, erred = r != 0, judged > 0, failed > 0
    return {"behaviour/tool_error_ratio": _mean(ratio[made]),
            "behaviour/tool_error_ratio_pos": _mean(ratio[made & pos]),
            "behaviour/error_share": _mean(erred.astype(float)), "behaviour/tool_calls": _mean(calls.astype(float)),
            "behaviour/no_call_share": _mean((calls == 0).astype(float)),
            "behaviour/pass_rate_clean": _mean(pos[made & ~erred].astype(float)),
            "behaviour/pass_rate_after_error": _mean(pos[erred].astype(float))}


def loss_metrics(stats: LossStats | Iterable[LossStats], num_tokens: float | None = None) -> dict[str, float]:
    """Token means of summed LossStats (one per micro-batch, or already summed over ranks). `num_tokens`
    defaults to their own token count; pass the global count when `stats` are one rank's."""
    items = [stats] if isinstance(stats, dict) else list(stats)
    total = {k: float(sum(s[k] for s in items)) for k in LossStats.__annotations__}
    n = num_tokens if num_tokens is not None else total["num_tokens"]
    d = max(n, 1.0)
    return {"train/clip_frac_low": total["clip_low_count"] / d, "train/clip_frac_high": total["clip_high_count"] / d,
            "train/clip_frac_dual": total["clip_dual_count"] / d, "train/approx_kl": total["approx_kl_sum"] / d,
            "train/pg_loss": total["pg_loss_sum"] / d, "train/kl": total["kl_sum"] / d,
            "train/entropy": total["entropy_sum"] / d, "train/num_tokens": float(n)}


def response_length_metrics(lengths: ArrayLike, truncated: ArrayLike | None = None) -> dict[str, float]:
    """Length statistics in tokens; `truncated` flags responses that hit the length budget."""
    x = np.asarray(lengths, dtype=np.float64)
    if x.size == 0:
        return {}
    out = {"response/length_mean(tokens)": float(x.mean()), "response/length_min(tokens)": float(x.min()),
           "response/length_p50(tokens)": float(np.percentile(x, 50)),
           "response/length_p90(tokens)": float(np.percentile(x, 90)), "response/length_max(tokens)": float(x.max())}
    if truncated is not None:
        out["response/truncated_frac"] = float(np.asarray(truncated, dtype=bool).mean())
    return out
