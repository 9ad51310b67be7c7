"""The numbers of a model that layouts and memory depend on, found without loading it (no torch).

Where they come from, first match wins: `model.tiny` (the CPU demo), `config.json` under `model.path`, or a
published shape whose name starts the model directory's name (`/lustre/Qwen3-14B-Base` -> `qwen3-14b`,
`Meta-Llama-3.1-8B-Instruct` -> `llama-3.1-8b`), so a recipe can be checked and planned on a login node before the
weights are copied there. A config.json of a family the trainer does not build (models/families.py) is refused.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rstar_hpc.models.families import FAMILIES, Llama3Rope, family_of, llama3_rope, rope_theta


def read_hf_config(config: dict | Path | str) -> dict:
    """A Hugging Face `config.json` as a dict (given the dict, the file, or its directory)."""
    if isinstance(config, dict):
        return config
    path = Path(config)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no Hugging Face config.json; point model.path at a directory written by "
                                f"save_pretrained (config.json + *.safetensors)")
    return json.loads(path.read_text())


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers and family of a checkpoint's config.json: the one parser of it (the trainer's
    `Arch` adds what megatron-core needs besides)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    family: str = "qwen3"
    rope_scaling: Llama3Rope | None = None
    # a mixture of experts in every layer (qwen3_moe); 0: dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False        # the top-k router weights renormalised to sum to 1
    router_aux_loss_coef: float = 0.0   # weight of the load-balancing loss in training

    @classmethod
    def from_hf_config(cls, config: dict | Path | str):
        c = read_hf_config(config)
        family = family_of(c)
        heads = c["num_attention_heads"]
        moe = {}
        if family.moe:   # transformers 5 writes num_experts as num_local_experts
            moe = dict(num_experts=c.get("num_experts", c.get("num_local_experts")),
                       num_experts_per_tok=c["num_experts_per_tok"], moe_intermediate_size=c["moe_intermediate_size"],
                       norm_topk_prob=bool(c.get("norm_topk_prob", False)),
                       router_aux_loss_coef=float(c.get("router_aux_loss_coef", 0.0)))
        return cls(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                   intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"], num_heads=heads,
                   num_kv_heads=c.get("num_key_value_heads", heads),
                   head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                   tie_word_embeddings=c.get("tie_word_embeddings", False),
                   rms_norm_eps=c.get("rms_norm_eps", 1e-6),
                   rope_theta=rope_theta(c, 1_000_000.0),
                   max_position_embeddings=c.get("max_position_embeddings", 40960),
                   family=family.name, rope_scaling=llama3_rope(c), **moe)

    @property
    def qkv_bias(self) -> bool:
        return FAMILIES[self.family].qkv_bias

    @property
    def qk_norm(self) -> bool:
        return FAMILIES[self.family].qk_norm

    @property
    def qkv_bias_params(self) -> int:
        """Biases of one layer's query, key and value projections (Qwen2's), 0 without."""
        return self.head_dim * (self.num_heads + 2 * self.num_kv_heads) if self.qkv_bias else 0

    @property
    def norm_params(self) -> int:
        """One layer's norm weights: the two pre-norms, and the query and key head norms (Qwen3's)."""
        return 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        return h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h + self.qkv_bias_params

    @property
    def expert_params(self) -> int:
        """One layer's routed experts (all of them), 0 for a dense model."""
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def mlp_params(self) -> int:
        """One layer's MLP: the SwiGLU, or every expert and the router."""
        if self.is_moe:
            return self.expert_params + self.hidden_size * self.num_experts
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def active_mlp_params(self) -> int:
        """The MLP parameters one token goes through: the top-k experts and the router."""
        if self.is_moe:
            return self.num_experts_per_tok * 3 * self.hidden_size * self.moe_intermediate_size + \
                self.hidden_size * self.num_experts
        return self.mlp_params

    @property
    def mlp_width(self) -> int:
        """The width tensor parallelism splits: the MLP's, or one expert's."""
        return self.moe_intermediate_size if self.is_moe else self.intermediate_size

    def _total(self, mlp: int) -> int:
        layer = self.attention_params + mlp + self.norm_params
        h = self.hidden_size
        return self.num_layers * layer + self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h

    @property
    def num_params(self) -> int:
        """Parameters of the Hugging Face model (embeddings once if tied): what memory and checkpoints hold."""
        return self._total(self.mlp_params)

    @property
    def active_params(self) -> int:
        """Parameters one token goes through (num_params for a dense model): what its FLOPs count."""
        return self._total(self.active_mlp_params)


def _qwen3(hidden: int, inter: int, layers: int, heads: int, kv: int, tied: bool) -> ModelShape:
    return ModelShape(vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                      num_heads=heads, num_kv_heads=kv, head_dim=128, tie_word_embeddings=tied)


def _qwen25(hidden: int, inter: int, layers: int, heads: int, kv: int, eps: float, theta: float = 1e6,
            positions: int = 131072) -> ModelShape:
    return ModelShape(vocab_size=152064, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                      num_heads=heads, num_kv_heads=kv, head_dim=128, rms_norm_eps=eps, rope_theta=theta,
                      max_position_embeddings=positions, family="qwen2")


def _llama31(hidden: int, inter: int, layers: int, heads: int) -> ModelShape:
    return ModelShape(vocab_size=128256, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                      num_heads=heads, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                      max_position_embeddings=131072, family="llama",
                      rope_scaling=Llama3Rope(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_position_embeddings=8192))


def _qwen3_moe(hidden: int, layers: int, heads: int, kv: int, experts: int, active: int, moe_inter: int,
               inter: int) -> ModelShape:
    return ModelShape(vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                      num_heads=heads, num_kv_heads=kv, head_dim=128, family="qwen3_moe", num_experts=experts,
                      num_experts_per_tok=active, moe_intermediate_size=moe_inter, norm_topk_prob=True,
                      router_aux_loss_coef=0.001)


# the published models (their config.json): dense Qwen3; Qwen2.5 7B and up (untied; 0.5B-3B tie theirs); Llama 3.1;
# Qwen3 MoE
PUBLISHED: dict[str, ModelShape] = {
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, 8, True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, 8, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, 8, False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, 8, False),
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4, 1e-6),
    "qwen2.5-math-7b": _qwen25(3584, 18944, 28, 28, 4, 1e-6, theta=10000.0, positions=4096),
    "qwen2.5-14b": _qwen25(5120, 13824, 48, 40, 8, 1e-5),
    "qwen2.5-32b": _qwen25(5120, 27648, 64, 40, 8, 1e-5),
    "llama-3.1-8b": _llama31(4096, 14336, 32, 32),
    "llama-3.1-70b": _llama31(8192, 28672, 80, 64),
    "qwen3-30b-a3b": _qwen3_moe(2048, 48, 32, 4, 128, 8, 768, 6144),
}


def published_shape(name: str) -> str | None:
    """The PUBLISHED key a model directory's name starts with (case and a leading `Meta-` aside), None if none."""
    name = name.lower().removeprefix("meta-")
    for key in sorted(PUBLISHED, key=len, reverse=True):  # qwen3-14b before qwen3-1...
        if name.startswith(key) and not name[len(key):len(key) + 1].isdigit():
            return key
    return None


def model_shape(model) -> tuple[ModelShape, str] | None:
    """(shape, where it came from) for a `model:` config section, or None if nothing says."""
    if model.path is None:
        t = model.tiny
        moe = dict(num_experts=t.num_experts, num_experts_per_tok=t.num_experts_per_tok,
                   moe_intermediate_size=t.moe_intermediate_size, norm_topk_prob=True,
                   router_aux_loss_coef=t.router_aux_loss_coef) if FAMILIES[t.family].moe else {}
        return ModelShape(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                          num_layers=t.num_layers, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
                          head_dim=t.head_dim, tie_word_embeddings=t.tied, family=t.family, **moe), "model.tiny"
    path = Path(model.path).expanduser()
    if (path / "config.json").is_file():
        return ModelShape.from_hf_config(path), str(path / "config.json")
    key = published_shape(path.name)
    if key is None:
        return None
    return PUBLISHED[key], f"published shape {key} (by the name of {path}; no config.json there)"
