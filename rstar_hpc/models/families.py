"""The model families the trainer builds, chosen by a checkpoint's config.json (`model_type`, else `architectures`).
No torch: config validation and the planner read it on login nodes, so an unsupported model is refused there.

All are pre-norm RMSNorm decoders with a SwiGLU MLP, rotate-half RoPE and grouped-query attention; they differ in
  * qwen3 (Qwen3 dense): RMSNorm on each query and key head before RoPE (`qk_norm`), no biases;
  * qwen2 (Qwen2, Qwen2.5): biases on the query, key and value projections (`qkv_bias`), no QK norm;
  * llama (Llama 3.x): no biases, no QK norm, and Llama 3's RoPE frequency scaling (`rope_type: llama3`);
  * qwen3_moe (Qwen3 MoE, Qwen3-30B-A3B): Qwen3's attention, and in every layer a mixture of experts in place of
    the MLP (a softmax top-k router, SwiGLU experts, no shared expert; megatron-core's MoE layer).
Each family's tied embeddings and rope theta are the checkpoint's own (models/shapes.py reads them).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3's RoPE scaling (config.json `rope_scaling`, or transformers 5's `rope_parameters`): frequencies of
    wavelength above original/low_freq_factor divided by `factor`, below original/high_freq_factor kept, a smooth
    mix between (transformers' `_compute_llama3_parameters`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class Family:
    name: str
    model_type: str        # config.json's, written on export with `architecture`
    architecture: str
    description: str
    qkv_bias: bool
    qk_norm: bool
    rope_types: tuple[str, ...] = ("default",)
    moe: bool = False

    def check(self, config: dict) -> None:
        """Refuse what the trainer cannot build of this family, naming it."""
        rope = rope_type(config)
        if rope not in self.rope_types:
            raise ValueError(f"rope type {rope!r}: the trainer builds {self.name} models with RoPE "
                             f"{' or '.join(self.rope_types)} only; use a checkpoint without that rope_scaling")
        if config.get("attention_bias") and not self.qkv_bias:
            raise ValueError(f"attention_bias=true: {self.description} has no attention biases; the trainer "
                             f"builds it without them")
        for key, refused in (("mlp_bias", True), ("use_sliding_window", True)):
            if config.get(key) == refused:
                raise ValueError(f"{key}={refused}: not supported by the trainer for {self.name} models")
        if windowed := sorted(set(config.get("layer_types") or []) - {"full_attention"}):
            raise ValueError(f"layer_types {windowed}: the trainer builds full-attention layers only")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config['hidden_act']!r}: the trainer builds SwiGLU (silu) MLPs only")
        if self.moe:   # dense layers among the sparse ones: Qwen3 MoE's published models have none
            if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
                raise ValueError(f"mlp_only_layers={config.get('mlp_only_layers')}, decoder_sparse_step="
                                 f"{config.get('decoder_sparse_step')}: the trainer builds {self.description} "
                                 f"with experts in every layer (mlp_only_layers [], decoder_sparse_step 1) only")
            if config.get("shared_expert_intermediate_size"):
                raise ValueError(f"shared_expert_intermediate_size: {self.description} has no shared expert")


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen3", "qwen3", "Qwen3ForCausalLM", "Qwen3 (dense)", qkv_bias=False, qk_norm=True),
    Family("qwen2", "qwen2", "Qwen2ForCausalLM", "Qwen2 / Qwen2.5", qkv_bias=True, qk_norm=False),
    Family("llama", "llama", "LlamaForCausalLM", "Llama 3.x", qkv_bias=False, qk_norm=False,
           rope_types=("default", "llama3")),
    Family("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3 MoE", qkv_bias=False, qk_norm=True, moe=True),
)}


def supported() -> str:
    return ", ".join(f"{f.name} ({f.description})" for f in FAMILIES.values())


def family_of(config: dict) -> Family:
    """The family of a config.json (as a dict), checked to be one the trainer builds; ValueError otherwise."""
    model_type, archs = config.get("model_type"), config.get("architectures") or []
    found = next((f for f in FAMILIES.values() if f.model_type == model_type), None) or \
        next((f for f in FAMILIES.values() if f.architecture in archs), None)
    if found is None:
        raise ValueError(f"model_type={model_type!r}, architectures={archs}: not a model family rstar-hpc trains; "
                         f"supported: {supported()}. Point model.path at a checkpoint of one of these")
    found.check(config)
    return found


def _rope(config: dict) -> dict:
    return config.get("rope_scaling") or config.get("rope_parameters") or {}


def rope_type(config: dict) -> str:
    rope = _rope(config)
    return rope.get("rope_type", rope.get("type")) or "default"


def rope_theta(config: dict, default: float) -> float:
    return float(config.get("rope_theta", _rope(config).get("rope_theta", default)))


def llama3_rope(config: dict) -> Llama3Rope | None:
    """The Llama 3 rope scaling of a config.json, None when it has none."""
    if rope_type(config) != "llama3":
        return None
    rope = _rope(config)
    return Llama3Rope(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                      high_freq_factor=float(rope["high_freq_factor"]),
                      original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
