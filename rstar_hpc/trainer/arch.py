"""The architecture the trainer builds: a Qwen3 checkpoint's numbers, checked to be a dense Qwen3 with plain RoPE.

Qwen3 = pre-norm RMSNorm, SwiGLU MLP, RoPE (rotate-half), grouped-query attention, RMSNorm on each query and
key head before RoPE (`qk_layernorm`), no biases, untied embeddings on the larger models. Only numbers here, no
torch: model.py maps them onto megatron-core, parallel_dims.py checks a layout against them.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from rstar_hpc.models.shapes import ModelShape, read_hf_config


@dataclass(frozen=True)
class Qwen3Arch(ModelShape):
    """The architecture numbers of a Qwen3 checkpoint (its config.json, parsed by models.shapes), checked to be a
    dense Qwen3 with plain RoPE: what the trainer builds."""

    @classmethod
    def from_hf_config(cls, config: dict | Path | str) -> Qwen3Arch:
        """Read a Hugging Face `config.json` (a dict, the file, or its directory)."""
        config = read_hf_config(config)
        arch = config.get("architectures") or []
        if config.get("model_type") != "qwen3" and "Qwen3ForCausalLM" not in arch:
            raise ValueError(f"model_type={config.get('model_type')!r}, architectures={arch}: the trainer builds "
                             f"Qwen3 (dense) models only; convert or pick a Qwen3 checkpoint")
        rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"rope type {rope_type!r} is not supported by the trainer (plain RoPE only)")
        if config.get("attention_bias", False):
            raise ValueError("attention_bias=true: Qwen3 has no attention biases; this checkpoint is not Qwen3")
        return super().from_hf_config(config)

    def to_dict(self) -> dict:
        return asdict(self)

    def padded_vocab_size(self, tp: int, multiple: int = 1) -> int:
        """Vocabulary rows in Megatron: a multiple of tp (VocabParallelEmbedding splits evenly)."""
        step = tp * multiple
        return math.ceil(self.vocab_size / step) * step
