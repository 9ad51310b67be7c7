"""GRPO-RoC (paper §2.2): reward, tool-quality penalties, Resample-on-Correct, advantages, loss, metrics.

Pure functions over arrays/tensors, each driven by its `rstar_hpc.config.algo` section or keyword arguments
with the same names. One step of the algorithm:

    results   = RewardScorer(cfg.reward).score_batch(responses, ground_truths)      # reward.py
    quality   = [trajectory_quality(resp, statuses, turns, cfg.roc) ...]            # quality.py
    selection = roc_downsample(uids, rewards, p_err, p_format, cfg.roc, seed=step)  # roc.py
    adv       = group_advantages(rewards[selection.keep], uids[selection.keep], cfg.loss)  # advantage.py
    loss, st  = policy_loss(logp, old_logp, adv_per_token, mask, global_num_tokens=n, cfg=cfg.loss)  # loss.py

Names are imported lazily so that `rstar_hpc.algo.reward` (and its verifier worker processes) never load torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "reward": ["RewardResult", "RewardScorer", "extract_answer", "last_boxed", "math_reward", "score_response"],
    "quality": ["FAILED_TOOL_STATUSES", "INFRA_TOOL_STATUSES", "TOOL_STATUSES", "Quality", "p_err", "p_format",
                "trajectory_quality"],
    "roc": ["RoCReason", "RoCSelection", "roc_downsample", "roc_split"],
    "advantage": ["group_advantages", "tokens_per_sample"],
    "loss": ["LossStats", "entropy_from_logits", "policy_loss"],
    "metrics": ["behaviour_metrics", "loss_metrics", "response_length_metrics", "roc_metrics"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = ["FAILED_TOOL_STATUSES", "INFRA_TOOL_STATUSES", "LossStats", "Quality", "RewardResult", "RewardScorer",
           "RoCReason", "RoCSelection", "TOOL_STATUSES", "behaviour_metrics", "entropy_from_logits", "extract_answer",
           "group_advantages", "last_boxed", "loss_metrics", "math_reward", "p_err", "p_format", "policy_loss",
           "response_length_metrics", "roc_downsample", "roc_metrics", "roc_split", "score_response",
           "tokens_per_sample", "trajectory_quality"]
assert sorted(__all__) == sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'rstar_hpc.algo' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rstar_hpc.algo.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # explicit re-exports for type checkers and IDEs
    from rstar_hpc.algo.advantage import group_advantages, tokens_per_sample
    from rstar_hpc.algo.loss import LossStats, entropy_from_logits, policy_loss
    from rstar_hpc.algo.metrics import behaviour_metrics, loss_metrics, response_length_metrics, roc_metrics
    from rstar_hpc.algo.quality import (
        FAILED_TOOL_STATUSES,
        INFRA_TOOL_STATUSES,
        TOOL_STATUSES,
        Quality,
        p_err,
        p_format,
        trajectory_quality,
    )
    from rstar_hpc.algo.reward import (
        RewardResult,
        RewardScorer,
        extract_answer,
        last_boxed,
        math_reward,
        score_response,
    )
    from rstar_hpc.algo.roc import RoCReason, RoCSelection, roc_downsample, roc_split
