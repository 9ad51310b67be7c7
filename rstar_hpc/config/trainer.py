"""Knobs of the trainer role (Megatron-core GRPO-RoC and SFT)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from rstar_hpc.config.base import Section


class OptimizerConfig(Section):
    lr: float = Field(1e-6, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.01, ge=0)
    warmup_steps: int = Field(20, ge=0)
    """Linear warm-up; then `schedule`."""
    schedule: Literal["constant", "cosine"] = "constant"
    """`constant` after warm-up (paper's RL); `cosine` decay (paper's SFT)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Floor of the cosine schedule, as a fraction of lr."""
    grad_clip: float = Field(1.0, gt=0)
    sft_schedule: Literal["constant", "cosine"] = "cosine"
    """Schedule of `kind: sft` stages (the paper's SFT recipe decays); RL stages use `schedule`."""


class CheckpointConfig(Section):
    save_every_steps: int = Field(10, ge=1)
    keep_last: int = Field(3, ge=1)
    """Committed checkpoints kept; the one `latest` points to is never deleted."""


class TrainerConfig(Section):
    backend: Literal["auto", "cpu", "cuda"] = "auto"
    """`cpu`: gloo + local layer spec; `cuda`: NCCL + the Transformer Engine spec (megatron-core's local spec with
    SDPA attention when TE is not installed, logged once); `auto` picks by GPU presence."""
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    micro_batch_tokens: int = Field(20480, ge=64)
    """Token budget of one packed micro-batch."""
    recompute_old_logprobs: bool = True
    """Recompute pi_old with the trainer instead of trusting the engine's logprobs."""
    optimizer: OptimizerConfig = OptimizerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    publish_keep_last: int = Field(2, ge=1)
    """Published policy versions kept for the rollout engines."""
    publish_max_shard_gb: float = Field(5.0, gt=0)
    """Size of one safetensors file of a published policy (Hugging Face's default sharding)."""
    producers: list[str] = Field(default_factory=lambda: ["rollout"])
    """Trajectory producers whose commit records make an RL step complete (the rollout role writes as
    `rollout`)."""
    trajectory_timeout_s: float = Field(3600.0, gt=0)
    """How long an RL step waits for its trajectories before failing with the missing producers named."""
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype. The optimizer keeps no separate fp32 master copy, so bfloat16 trades update precision
    for memory; keep float32 unless memory forces it."""
