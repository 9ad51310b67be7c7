"""The architecture the trainer builds: a checkpoint's numbers and family (qwen3, qwen2, llama), as
models/shapes.py reads them from its config.json and models/families.py checks them.

Every family is a pre-norm RMSNorm decoder with a SwiGLU MLP, rotate-half RoPE and grouped-query attention; the
family adds QKV biases (qwen2), RMSNorm on each query and key head (qwen3) or Llama 3's RoPE scaling (llama).
Only numbers here, no torch: model.py maps them onto megatron-core, hf_convert.py maps the weights, parallel_dims.py
checks a layout against them.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from rstar_hpc.models.shapes import ModelShape


@dataclass(frozen=True)
class Arch(ModelShape):
    """A checkpoint's architecture (its config.json, parsed by models.shapes; a family the trainer does not build
    is refused there): what the trainer builds."""

    def to_dict(self) -> dict:
        return asdict(self)

    def padded_vocab_size(self, tp: int, multiple: int = 1) -> int:
        """Vocabulary rows in Megatron: a multiple of tp (VocabParallelEmbedding splits evenly)."""
        step = tp * multiple
        return math.ceil(self.vocab_size / step) * step
