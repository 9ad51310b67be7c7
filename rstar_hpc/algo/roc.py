"""Resample-on-Correct down-sampling (paper §2.2.3; public code microsoft/rStar rstar2_agent/down_sample/).

For each prompt (group) of 2G rollouts, keep G = `down_sample_to_n`:
  1. `reject_equal_reward`: drop groups whose rewards are all equal (all right or all wrong).
  2. Split G between the classes by rounding, with minimums (the public code's rule, which always sums to G,
     unlike the paper's "floor(|O_neg|/2) + half the positives"):
         k_neg = round_half_even(n_neg * G / n)            k_pos = G - k_neg
         if k_neg <= min(min_zero, n_neg):     k_neg = min(min_zero, n_neg);     k_pos = G - k_neg
         if k_pos <= min(min_non_zero, n_pos): k_pos = min(min_non_zero, n_pos); k_neg = G - k_pos
     (The code rounds k_pos separately; for even G both agree; for odd G that sum can miss G by one.)
  3. Negatives (reward 0): k_neg uniformly at random without replacement (the code takes the first k_neg in
     rollout order, which is uniform for i.i.d. rollouts).
  4. Positives (reward != 0), by p_total = p_err [roc_error_ratio] + p_format [roc_answer_format]:
       weighted  sample k_pos without replacement with weight 1/(p_total + weight_eps): the paper's rule; eps
                 (the paper leaves p_total = 0 open) keeps weights finite. Drawn as Gumbel-top-k, which is
                 exactly sequential weighted sampling without replacement, vectorised over all groups.
       topk      the k_pos lowest penalties, ties in rollout order (stable): the public code.
The ablation modes (`mode`) share steps 1 and the group-size rules: `random` replaces 2-4 with G drawn uniformly
from the group, whatever their rewards; `grpo` groups were sampled with G rollouts and are kept whole.
A group larger than G is selected as above; exactly G is kept whole; smaller than G (rollouts were lost) is
dropped as in the public code, or kept whole with `keep_small_groups`. `down_sample_to_n <= 0` skips 2-4.
Same inputs and seed give the same selection: the trainer runs it (trainer/rl.py), and `traj show` reruns it to
show a trajectory's decision.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from numpy.typing import ArrayLike

from rstar_hpc.algo._config import resolve
from rstar_hpc.config.algo import RoCConfig
from rstar_hpc.exchange.columns import TrajectoryColumns
from rstar_hpc.exchange.tool_status import INFRA_TOOL_STATUSES


class RoCReason(enum.IntEnum):
    KEPT_POSITIVE = 0
    KEPT_NEGATIVE = 1
    KEPT_GROUP = 2
    """Kept without selection: down-sampling off, or the group already has at most G rollouts."""
    DROPPED_POSITIVE = 3
    DROPPED_NEGATIVE = 4
    DROPPED_EQUAL_REWARD = 5
    DROPPED_SMALL_GROUP = 6
    DROPPED_TOOL_INFRA = 7
    """A tool call of it failed for the sandbox's reasons (`excluded`): left out before selection."""


@dataclass(frozen=True)
class RoCSelection:
    keep: np.ndarray
    """bool [n]: trajectories kept for training."""
    reason: np.ndarray
    """int8 [n]: a RoCReason per trajectory."""
    penalty: np.ndarray
    """float [n]: p_total used to rank positives (computed for every trajectory)."""
    group: np.ndarray
    """int [n]: group index (0..num_groups-1, in sorted order of the group ids)."""

    @property
    def indices(self) -> np.ndarray:
        return np.flatnonzero(self.keep)

    def reason_names(self) -> list[str]:
        return [RoCReason(c).name.lower() for c in self.reason]


def _split(n_pos, n_neg, n: int, min_neg: int, min_pos: int):
    n_pos, n_neg = np.asarray(n_pos, np.int64), np.asarray(n_neg, np.int64)
    k_neg = np.rint(n_neg * n / (n_pos + n_neg)).astype(np.int64)  # rint rounds half to even, like Python
    k_pos = n - k_neg
    m = np.minimum(min_neg, n_neg)
    low = k_neg <= m
    k_neg, k_pos = np.where(low, m, k_neg), np.where(low, n - m, k_pos)
    m = np.minimum(min_pos, n_pos)
    low = k_pos <= m
    return np.where(low, m, k_pos), np.where(low, n - m, k_neg)


def roc_split(num_pos: int, num_neg: int, cfg: RoCConfig | None = None, **kwargs) -> tuple[int, int]:
    """(positives kept, negatives kept) for a group larger than `down_sample_to_n` (rule 2 above)."""
    cfg = resolve(RoCConfig, cfg, kwargs)
    if cfg.down_sample_to_n <= 0 or num_pos + num_neg <= cfg.down_sample_to_n or min(num_pos, num_neg) < 0:
        raise ValueError(f"roc_split needs 0 < down_sample_to_n ({cfg.down_sample_to_n}) < group size "
                         f"({num_pos} + {num_neg}) and non-negative counts")
    k_pos, k_neg = _split(num_pos, num_neg, cfg.down_sample_to_n, cfg.min_zero_reward_trace_num,
                          cfg.min_non_zero_reward_trace_num)
    return int(k_pos), int(k_neg)


def _as_1d(name: str, x: ArrayLike | None, n: int) -> np.ndarray:
    a = np.zeros(n) if x is None else np.asarray(x, dtype=np.float64)
    if a.shape != (n,):
        raise ValueError(f"{name} has shape {a.shape}, expected ({n},): one value per trajectory")
    if not np.isfinite(a).all():
        raise ValueError(f"{name} holds NaN or inf at index {int(np.flatnonzero(~np.isfinite(a))[0])}")
    return a


def roc_downsample(group_ids: ArrayLike, rewards: ArrayLike, p_err: ArrayLike | None = None,
                   p_format: ArrayLike | None = None, cfg: RoCConfig | None = None, *, seed: int,
                   excluded: ArrayLike | None = None, **kwargs) -> RoCSelection:
    """Select the trajectories to train on. `group_ids` (any sortable ids: prompt uids) groups the rollouts of
    a prompt, in any order; `rewards`, `p_err`, `p_format` hold one value per trajectory (the penalties may be
    None when their `roc_*` switch is off). `excluded` (bool per trajectory) marks rollouts that are no sample
    of the policy (a tool call lost to the sandbox's infrastructure): they are dropped first and the rest are
    selected as if they had never been generated (a group left smaller than G follows keep_small_groups).
    Returns what was kept and, per trajectory, why."""
    cfg = resolve(RoCConfig, cfg, kwargs)
    rewards = np.asarray(rewards, dtype=np.float64)
    if rewards.ndim != 1:
        raise ValueError(f"rewards has shape {rewards.shape}; pass one scalar reward per trajectory (1-D)")
    n = rewards.shape[0]
    rewards = _as_1d("rewards", rewards, n)
    for name, x, on in (("p_err", p_err, cfg.roc_error_ratio), ("p_format", p_format, cfg.roc_answer_format)):
        if on and x is None and cfg.mode == "roc" and cfg.down_sample_to_n > 0:
            raise ValueError(f"{name} is needed because roc_{'error_ratio' if name == 'p_err' else 'answer_format'}"
                             " is on; pass it, or turn that switch off")
    penalty = (cfg.roc_error_ratio * _as_1d("p_err", p_err, n)
               + cfg.roc_answer_format * _as_1d("p_format", p_format, n))
    ids = np.asarray(group_ids)
    if ids.shape != (n,):
        raise ValueError(f"group_ids has shape {ids.shape}, expected ({n},): one id per trajectory")
    _, g = np.unique(ids, return_inverse=True)
    g = g.reshape(-1)
    if excluded is not None:
        out = np.asarray(excluded, dtype=bool).reshape(-1)
        if out.shape != (n,):
            raise ValueError(f"excluded has shape {out.shape}, expected ({n},): one flag per trajectory")
        if out.any():   # select among the others as if these had never been generated
            sub = np.flatnonzero(~out)
            inner = roc_downsample(ids[sub], rewards[sub], None if p_err is None else np.asarray(p_err)[sub],
                                   None if p_format is None else np.asarray(p_format)[sub], cfg, seed=seed)
            keep, reason = np.zeros(n, dtype=bool), np.full(n, RoCReason.DROPPED_TOOL_INFRA, dtype=np.int8)
            keep[sub], reason[sub] = inner.keep, inner.reason
            return RoCSelection(keep, reason, penalty, g)
    reason = np.full(n, RoCReason.KEPT_GROUP, dtype=np.int8)
    if n == 0:
        return RoCSelection(reason == RoCReason.KEPT_GROUP, reason, penalty, g)

    pos = rewards != 0
    size, n_pos = np.bincount(g), np.bincount(g, weights=pos).astype(np.int64)
    equal = (n_pos == 0) | (n_pos == size)
    dropped = equal if cfg.reject_equal_reward else np.zeros_like(equal)
    reason[dropped[g]] = RoCReason.DROPPED_EQUAL_REWARD
    target = cfg.down_sample_to_n
    if target > 0:
        small = ~dropped & (size < target)
        if not cfg.keep_small_groups:
            reason[small[g]] = RoCReason.DROPPED_SMALL_GROUP
        # grpo groups hold G already (the rollout sampled G): nothing to choose
        select = ~dropped & (size > target) & (cfg.mode != "grpo")
        u = np.random.default_rng(seed).random(n)
        if cfg.mode == "random":   # G of the group uniformly, rewards ignored
            seg, key, quota = g, u, np.full(n, target)
        else:
            k_pos, k_neg = _split(n_pos, size - n_pos, target, cfg.min_zero_reward_trace_num,
                                  cfg.min_non_zero_reward_trace_num)
            if cfg.positive_selection == "weighted":
                gumbel = -np.log(-np.log(np.clip(u, 1e-300, 1.0)))
                pos_key = -(gumbel - np.log(penalty + cfg.weight_eps))  # ascending key = descending log w + G
            else:
                pos_key = penalty
            key = np.where(pos, pos_key, u)  # negatives: a uniformly random order
            seg, quota = 2 * g + pos, np.where(pos, k_pos[g], k_neg[g])
        order = np.lexsort((np.arange(n), key, seg))
        seg_sorted = seg[order]
        first = np.r_[True, seg_sorted[1:] != seg_sorted[:-1]]
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n) - np.maximum.accumulate(np.where(first, np.arange(n), 0))
        chosen = rank < quota
        in_sel = select[g]
        reason[in_sel] = np.select(
            [chosen[in_sel] & pos[in_sel], chosen[in_sel], pos[in_sel]],
            [RoCReason.KEPT_POSITIVE, RoCReason.KEPT_NEGATIVE, RoCReason.DROPPED_POSITIVE],
            RoCReason.DROPPED_NEGATIVE)
    keep = np.isin(reason, [RoCReason.KEPT_POSITIVE, RoCReason.KEPT_NEGATIVE, RoCReason.KEPT_GROUP])
    return RoCSelection(keep, reason, penalty, g)


# --------------------------------------------------------------------------------------------------
# one committed step, as the trainer sees it


def step_seed(run_seed: int, step: int) -> int:
    """The selection seed of an rl step: the run's seed and the step, so a rerun of the step selects the same."""
    return run_seed * 1_000_003 + step


def tool_infra_failed(table: pa.Table) -> np.ndarray:
    """Per row: did any of its tool calls fail for the sandbox's reasons (INFRA_TOOL_STATUSES)?"""
    status = TrajectoryColumns(table).tool_call_status
    return status.row_sums(np.isin(status.values, sorted(INFRA_TOOL_STATUSES))) > 0


def select_step(table: pa.Table, cfg: RoCConfig, *, run_seed: int, step: int) -> RoCSelection:
    """RoC over one step's committed rows (a step holds whole groups): what the trainer trains, and what
    `traj show` reports as a trajectory's decision."""
    cols = TrajectoryColumns(table)
    excluded = tool_infra_failed(table) if cfg.drop_tool_infra_failures else None
    return roc_downsample(cols.prompt_uid, cols.reward, cols.p_err, cols.p_format, cfg,
                          seed=step_seed(run_seed, step), excluded=excluded)
