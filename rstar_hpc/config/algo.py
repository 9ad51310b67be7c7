"""Knobs of the GRPO-RoC algorithm: reward, Resample-on-Correct, advantages and the policy loss.

The RoC section keeps the public recipe's names (rStar `augmentation.down_sampling_config.*`); that path
is accepted in YAML and overrides as an alias of `algo.roc.*` (see run.ALIASES).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rstar_hpc.config.base import Section


class RewardConfig(Section):
    answer_extraction: Literal["answer_tag", "last_boxed"] = "answer_tag"
    """`answer_tag`: the last \\boxed{} inside <answer>...</answer> (the paper); `last_boxed`: the last
    \\boxed{} anywhere in the response (the public code)."""
    timeout_s: float = Field(2.0, gt=0, le=60)
    """Hard limit on the CPU time of verifying one answer (wall time is capped at 4x it, for a contended
    node); slower verifications are killed and score 0 with a reason."""
    num_workers: int = Field(0, ge=0)
    """Processes for batch scoring; 0 means one per core."""


class RoCConfig(Section):
    """Resample-on-Correct down-sampling (paper §2.2.3; microsoft/rStar rstar2_agent/down_sample/)."""

    mode: Literal["roc", "grpo", "random"] = "roc"
    """How a group of G trained rollouts is made. `roc`: sample 2G (algo.num_samples_per_prompt), keep G by
    Resample-on-Correct (the paper). `grpo`: sample G (down_sample_to_n) and train them all: the paper's "GRPO with
    tool" baseline (§5.3), the fair ablation. `random`: sample 2G and keep G uniformly at random, a control that
    separates RoC's selection from its oversampling. reject_equal_reward, the small-group rule and
    drop_tool_infra_failures apply in every mode, so the modes differ only in how the G are chosen."""
    down_sample_to_n: int = Field(16, ge=0)
    """G: rollouts trained per prompt (roc and random keep G of the 2G generated; grpo generates G); <= 0 disables
    selection (every one of num_samples_per_prompt is trained)."""
    reject_equal_reward: bool = True
    """Drop prompts whose rollouts all have the same reward (all right or all wrong)."""
    roc_error_ratio: bool = True
    """Add p_err (failed tool calls / tool calls, 0.5 without any) to a positive's penalty."""
    roc_answer_format: bool = True
    """Add p_format (missing or repeated <answer>) to a positive's penalty."""
    min_zero_reward_trace_num: int = Field(2, ge=0)
    """Negatives kept at least, when that many exist."""
    min_non_zero_reward_trace_num: int = Field(2, ge=0)
    """Positives kept at least, when that many exist."""
    keep_small_groups: bool = False
    """A group with fewer than down_sample_to_n rollouts (some were lost): keep it whole, or drop it as the
    public code does (default)."""
    positive_selection: Literal["weighted", "topk"] = "weighted"
    """`weighted`: sample positives without replacement with weight 1/(p_total + eps) (the paper);
    `topk`: stable lowest-penalty top-k (the public code)."""
    weight_eps: float = Field(0.1, gt=0)
    """eps of the weighted mode, so p_total = 0 gets a finite weight: weights span 1/(2 + eps) to 1/eps, so
    0.1 lets a clean positive be picked up to 21x as readily as the worst one."""
    drop_tool_infra_failures: bool = True
    """Leave out, before selection, every rollout with a tool call the sandbox's infrastructure lost (status
    internal_error or unavailable: a sandbox died mid-call, no service answered after the client's retries).
    Its later turns answer a failure the policy did not cause. An rstar-hpc addition; counted in
    roc/num_dropped_tool_infra."""
    count_first_turn: bool = True
    """Count the first assistant turn in p_format's turn count (the paper's intent); the public code
    never counts it."""

    @model_validator(mode="before")
    @classmethod
    def _public_switch(cls, data):
        """The public recipe's master switch: `true` is the default; `false` trained all 2G there, an ablation that
        doubles GRPO's data against RoC's, so it is refused with the fair replacement named."""
        if isinstance(data, dict) and "do_down_sampling" in data:
            data = dict(data)
            if not data.pop("do_down_sampling"):
                raise ValueError("do_down_sampling: false is replaced by mode: grpo, which samples G = "
                                 "down_sample_to_n rollouts per prompt and trains them all (the paper's GRPO "
                                 "baseline); to train every one of num_samples_per_prompt, also set "
                                 "down_sample_to_n: 0")
        return data

    @model_validator(mode="after")
    def _minimums_fit(self) -> "RoCConfig":
        if self.down_sample_to_n > 0 and (
            self.min_zero_reward_trace_num + self.min_non_zero_reward_trace_num > self.down_sample_to_n
        ):
            raise ValueError(
                f"min_zero_reward_trace_num + min_non_zero_reward_trace_num "
                f"({self.min_zero_reward_trace_num} + {self.min_non_zero_reward_trace_num}) must be <= "
                f"down_sample_to_n ({self.down_sample_to_n})"
            )
        return self


class LossConfig(Section):
    clip_ratio_low: float = Field(0.2, ge=0, lt=1)
    """eps_low of the clipped surrogate."""
    clip_ratio_high: float = Field(0.28, ge=0)
    """eps_high (Clip-Higher)."""
    clip_ratio_c: float | None = Field(None, gt=1)
    """Dual-clip bound for negative advantages (verl uses 3.0); null disables it."""
    norm_adv_by_std: bool = True
    """Divide group advantages by the (unbiased) group std."""
    kl_coef: float = Field(0.0, ge=0)
    """Coefficient of the low-variance (k3) KL penalty against reference log-probs passed to the loss;
    0 (the paper) disables it. The trainer keeps no reference policy: rl stages refuse > 0."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus; 0 (the paper) disables it. The trainer logs the entropy (train/entropy) without its
    gradient: rl stages refuse > 0."""
    log_ratio_clamp: float = Field(20.0, gt=0)
    """Clamp on log(pi/pi_old) before exp, as verl does, against overflow."""
    tis_cap: float | None = Field(2.0, ge=1)
    """Truncated importance sampling, on every trained token that a policy version other than the trainer's
    generated (each token records its version; overlap mode, max_policy_lag, partial rollouts, an engine that fell
    back to older files: whatever the mode; algo.tis.scope: all takes every token): its loss is weighted by
    w = min(pi_old / pi_behaviour, tis_cap), pi_old the trainer's recomputed logprob under its current weights
    (trainer.recompute_old_logprobs) and pi_behaviour the engine's. The clipped ratio pi / pi_old then bounds the
    update as on-policy PPO does, and w corrects the sampling distribution (AReaL's decoupled objective; verl's and
    Yao et al.'s TIS, whose cap of 2 this follows: it bounds the variance a token whose probability rose a lot
    since it was sampled can add, at the cost of a small bias). null: no weight (the ratio alone, against pi_old)."""


class TISConfig(Section):
    """Which tokens truncated importance sampling weights (its cap: algo.loss.tis_cap)."""

    scope: Literal["stale", "all"] = "stale"
    """`stale`: only tokens a policy version other than the trainer's generated. `all`: every trained token, the
    trainer's own version's too, so the numeric gap between the engine's and the trainer's logprobs (bf16 kernels,
    other reductions: train/logprob_mismatch_mean) is corrected as well, as verl and slime do. Needs
    trainer.recompute_old_logprobs and a tis_cap."""


class AlgoConfig(Section):
    num_samples_per_prompt: int = Field(32, ge=1)
    """2G: rollouts generated per prompt before RoC (roc and random modes; grpo generates G)."""
    reward: RewardConfig = RewardConfig()
    roc: RoCConfig = RoCConfig()
    loss: LossConfig = LossConfig()
    tis: TISConfig = TISConfig()

    @property
    def samples_per_prompt(self) -> int:
        """Rollouts an rl step generates per prompt: 2G, or G in grpo mode."""
        g = self.roc.down_sample_to_n
        return g if self.roc.mode == "grpo" and g > 0 else self.num_samples_per_prompt

    @property
    def trained_per_prompt(self) -> int:
        """Rollouts an rl step trains per kept prompt: G (every sample where selection is off)."""
        g = self.roc.down_sample_to_n
        return g if 0 < g <= self.samples_per_prompt else self.samples_per_prompt
