"""The stage kinds of the pipeline, one small spec each: a stage holds only its kind's fields, so a field of another
kind is an error that names the kind (`stages.5 (eval): lr is not a field of an eval stage`).

    sft          trainer            chat samples of `data`, `num_steps` optimizer steps
    rl           trainer + rollout  GRPO-RoC on the prompts of `data`, `num_steps` steps (`val_every`: validated
                                    on `val_data` every N steps)
    hard_subset  rollout            `num_samples` rollouts per prompt of `data` with the stage's starting policy; keeps
                                    the prompts it does not solve every time (later stages: `data: "@<this stage>"`)
    eval         rollout            the `eval` section's protocol on `benchmarks`

Which role works in which kind, and when a stage is done, is rstar_hpc.pipeline's business.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, NamedTuple, Union

from pydantic import Field, model_validator

from rstar_hpc.config.base import Section

STAGE_OUTPUT = "@"   # `data: "@<stage>"`: the data set an earlier hard_subset stage wrote
# the values the one flat stage spec of earlier versions wrote into every saved config.yaml for every kind
_FLAT_DEFAULTS = {"num_steps": 1, "reset_optimizer": False, "drop_unsolved": False, "benchmarks": {}}


class _Stage(Section):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_-]+$")
    data: str | None = None
    """Dataset: a JSONL or Parquet file of prompts with ground truth (rl, hard_subset), chat samples (sft), 'demo'
    (the built-in demo set), or "@<stage>" for the subset an earlier hard_subset stage built (rl)."""
    prompts_per_step: int = Field(512, ge=1)
    """Prompts per RL step (paper: 512); for SFT, samples per step; for hard_subset and eval, prompts per rollout
    step (the unit of progress that survives a restart)."""
    max_prompts: int | None = Field(None, ge=1)
    """Use only the first N prompts of `data` (of each benchmark, in eval): a quick eval, a hard subset mined from
    part of a large set, a CI-sized run. Null: all of them."""

    @model_validator(mode="before")
    @classmethod
    def _earlier_flat_spec(cls, data):
        """A run directory saved by an earlier version holds every field of every kind at its default (null, false,
        {}, num_steps 1): those are dropped, so `launch RUN/config.yaml` resumes it. Any other value of a field of
        another kind is still refused."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if not (k not in fields and (v is None or (k in _FLAT_DEFAULTS and v == _FLAT_DEFAULTS[k])))
                and not (k in fields and v is None and fields[k].default is not None)}


class _TrainerStage(_Stage):
    num_steps: int = Field(1, ge=1)
    """Optimizer steps."""
    lr: float | None = Field(None, gt=0)
    """Overrides trainer.optimizer.lr in this stage."""
    warmup_steps: int | None = Field(None, ge=0)
    """Linear lr warm-up steps of this stage. Default: trainer.optimizer.warmup_steps where the optimizer starts a
    phase (the first trainer stage, sft -> rl, reset_optimizer), else none (pipeline.warmup_steps)."""
    reset_optimizer: bool = False
    """Start this stage with fresh optimizer state (the paper's stage 3)."""


class _RolloutStage(_Stage):
    max_response_length: int | None = Field(None, ge=16)
    """Overrides rollout.agent.max_response_length (eval: eval.max_response_length) in this stage (paper: 8K,
    12K, 12K)."""
    max_turns: int | None = Field(None, ge=1)
    """Overrides rollout.agent.max_turns (eval: eval.max_turns) in this stage (paper: 10, 10, 15; eval 30)."""
    max_model_len: int | None = Field(None, ge=64)
    """The engine context this stage needs, when it is more than rollout.engine.max_model_len (an eval with the
    paper's 30K-token budget). A rollout job builds its engines with the largest context of the stages it runs; vLLM
    reserves nothing per token of context, only checks that one sequence fits the KV cache."""
    keep_system: bool = False
    """Keep the system turn of prompts that carry one: a verl-schema `prompt` list (microsoft/rStar's
    data_preprocess, verl's examples) or a `system` column. Applies to every prompt file this stage reads: `data`
    ("@<stage>" subsets too: a subset holds a system turn only where its hard_subset stage kept one), `benchmarks`
    (eval), `val_data` (rl). False (the default): such turns are dropped, and every prompt gets the run's system
    turn. True: a prompt's own system turn takes the place of the run's system text in that prompt, where the user's
    data put it (the system turn, before the question): with rollout.agent.system_prompt null it replaces rStar2's
    preamble and the python tool's schema section still follows it (as the chat template renders a conversation's
    own system message with tools: what verl renders from the row); with a custom rollout.agent.system_prompt
    (which carries no tool section) it replaces that text whole. Prompts without a system turn are unchanged."""


class SFTStage(_TrainerStage):
    """Non-reasoning SFT (the cold start): the trainer on the chat samples of `data`."""

    kind: Literal["sft"]


class RLStage(_TrainerStage, _RolloutStage):
    """GRPO-RoC: the rollout samples each step's prompts, the trainer trains on what it committed."""

    kind: Literal["rl"]
    val_every: int | None = Field(None, ge=1)
    """Validate every N steps (the public recipe: 5): the policy of step 0, N, 2N, ... and the stage's final one
    scored avg@val_k pass@1 on `val_data` by the rollout (rstar_hpc/rollout/validation.py). Null: no validation."""
    val_data: str | dict[str, str] | None = None
    """Held-out problems with answers: a JSONL or Parquet file ('demo': the demo's eval set), or {name: file}."""
    val_k: int | None = Field(None, ge=1)
    """Samples per validation problem (default eval.k); temperature and top_p are the eval section's, the turn and
    response budget this stage's."""
    val_max_prompts: int | None = Field(None, ge=1)
    """Use only the first N problems of each validation file. Null: all of them."""

    @model_validator(mode="after")
    def _validation(self) -> RLStage:
        if self.val_every and not self.val_data:
            raise ValueError(f"stage {self.name!r} (rl): val_every={self.val_every} needs the held-out problems: set "
                             f"stages[{self.name}].val_data to a file (or {{name: file}}), or drop val_every")
        if self.val_data and not self.val_every:
            raise ValueError(f"stage {self.name!r} (rl): val_data is set but val_every is not: set stages["
                             f"{self.name}].val_every to N to validate every N steps, or drop val_data")
        return self

    def val_files(self) -> dict[str, str]:
        """Name -> file of each validation set (none without validation)."""
        if not self.val_data:
            return {}
        if isinstance(self.val_data, dict):
            return dict(self.val_data)
        return {Path(self.val_data).stem if self.val_data != "demo" else "demo": self.val_data}


class HardSubsetStage(_RolloutStage):
    """The rollout samples `num_samples` rollouts per prompt of `data` with the stage's starting policy and keeps the
    prompts it does not solve every time; later stages read them as `data: "@<this stage>"`."""

    kind: Literal["hard_subset"]
    num_samples: int = Field(8, ge=1)
    """Rollouts per prompt (the paper's 8)."""
    drop_unsolved: bool = False
    """Also drop the prompts solved in none of the rollouts (the paper keeps them)."""

    @model_validator(mode="after")
    def _source(self) -> HardSubsetStage:
        if not self.data or self.data.startswith(STAGE_OUTPUT):
            raise ValueError(f"stage {self.name!r} (hard_subset): data must be the source data file (or 'demo')")
        return self


class EvalStage(_RolloutStage):
    """The `eval` section's protocol (avg@k pass@1) on `benchmarks`, with the stage's starting policy."""

    kind: Literal["eval"]
    benchmarks: dict[str, str] = Field(default_factory=dict)
    """Benchmark name -> JSONL or Parquet file of problems with answers ('demo': the demo's eval set). With none,
    `data` is the one benchmark, named after its file."""
    num_samples: int | None = Field(None, ge=1)
    """Samples per problem (default eval.k)."""
    temperature: float | None = Field(None, ge=0)
    """Sampling temperature (default eval.temperature)."""
    top_p: float | None = Field(None, gt=0, le=1)
    """Nucleus sampling (default eval.top_p)."""

    @model_validator(mode="after")
    def _something_to_evaluate(self) -> EvalStage:
        if not self.benchmarks and not self.data:
            raise ValueError(f"stage {self.name!r} (eval): name its benchmarks ({{name: file}}) or its data file")
        return self

    def benchmark_files(self) -> dict[str, str]:
        """Name -> file of each benchmark."""
        if self.benchmarks:
            return dict(self.benchmarks)
        return {Path(self.data).stem if self.data != "demo" else "demo": self.data}


def val_stage(name: str) -> str:
    """Where rl stage `name`'s validation passes keep their trajectories: traj/<name>-val/step-<N>/ (N the step)."""
    return f"{name}-val"


STAGE_KINDS = {"sft": SFTStage, "rl": RLStage, "hard_subset": HardSubsetStage, "eval": EvalStage}
StageConfig = Annotated[Union[SFTStage, RLStage, HardSubsetStage, EvalStage], Field(discriminator="kind")]
"""One stage of the pipeline: its `kind` picks the spec."""


class StageLimits(NamedTuple):
    """A rollout stage's response budget, turn limit and sampling, as its trajectories run (RunConfig.stage_limits
    derives them: the stage's own, else the agent loop's defaults; an eval stage: the eval protocol's).
    temperature/top_p None: the engine's (rollout.agent's)."""
    max_response_length: int
    max_turns: int
    temperature: float | None = None
    top_p: float | None = None

    def sampling(self) -> dict | None:
        """The engine's sampling overrides, if any."""
        out = {k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p)) if v is not None}
        return out or None
