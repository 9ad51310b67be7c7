"""The numbers of a Qwen3 model that layouts and memory depend on, found without loading it (no torch).

Where they come from, first match wins: `model.tiny` (the CPU demo), `config.json` under `model.path`, or a
published Qwen3 shape whose name starts the model directory's name (`/lustre/Qwen3-14B-Base` -> `qwen3-14b`),
so a recipe can be checked and planned on a login node before the weights are copied there.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


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
    """The architecture numbers of a checkpoint's config.json: the one parser of it (the trainer's Qwen3Arch adds
    the checks that make it a Qwen3)."""

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

    @classmethod
    def from_hf_config(cls, config: dict | Path | str):
        c = read_hf_config(config)
        heads = c["num_attention_heads"]
        rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
        return cls(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                   intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"], num_heads=heads,
                   num_kv_heads=c.get("num_key_value_heads", heads),
                   head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                   tie_word_embeddings=c.get("tie_word_embeddings", False),
                   rms_norm_eps=c.get("rms_norm_eps", 1e-6),
                   rope_theta=float(c.get("rope_theta", rope.get("rope_theta", 1_000_000.0))),
                   max_position_embeddings=c.get("max_position_embeddings", 40960))

    @property
    def num_params(self) -> int:
        """Parameters of the Hugging Face model (embeddings once if tied)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h + 2 * d
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        return self.num_layers * layer + self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h


def _qwen3(hidden: int, inter: int, layers: int, heads: int, kv: int, tied: bool) -> ModelShape:
    return ModelShape(vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                      num_heads=heads, num_kv_heads=kv, head_dim=128, tie_word_embeddings=tied)


# the published dense Qwen3 models (their config.json)
PUBLISHED: dict[str, ModelShape] = {
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, 8, True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, 8, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, 8, False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, 8, False),
}


def model_shape(model) -> tuple[ModelShape, str] | None:
    """(shape, where it came from) for a `model:` config section, or None if nothing says."""
    if model.path is None:
        t = model.tiny
        return ModelShape(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                          num_layers=t.num_layers, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
                          head_dim=t.head_dim), "model.tiny"
    path = Path(model.path).expanduser()
    if (path / "config.json").is_file():
        return ModelShape.from_hf_config(path), str(path / "config.json")
    name = path.name.lower()
    for key in sorted(PUBLISHED, key=len, reverse=True):  # qwen3-14b before qwen3-1...
        if name.startswith(key) and not name[len(key):len(key) + 1].isdigit():
            return PUBLISHED[key], f"published shape {key} (by the name of {path}; no config.json there)"
    return None
