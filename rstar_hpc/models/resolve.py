"""Find the policy's Hugging Face directory for a config, building the tiny model when the config asks."""
from __future__ import annotations

from pathlib import Path

from rstar_hpc.config import ConfigError, RunConfig


class ModelNotFoundError(ConfigError):
    """model.path names no usable Hugging Face model directory."""


def resolve_model(cfg: RunConfig, *, build: bool = True) -> Path:
    path = cfg.model_dir()
    if cfg.model.path is None:
        from rstar_hpc.models.tiny import is_tiny_model, make_tiny_model

        if not is_tiny_model(path, cfg.model.tiny):
            if not build:
                raise ModelNotFoundError(f"tiny model {path} is not built yet; run `rstar-hpc make-tiny-model {path}`")
            make_tiny_model(path, cfg.model.tiny)
        return path
    if not path.exists():
        raise ModelNotFoundError(
            f"model.path: {path} does not exist. Point model.path at a Hugging Face model directory "
            f"(config.json + *.safetensors + tokenizer), e.g. model.path=/lustre/models/Qwen3-14B-Base, or build a "
            f"tiny one: `rstar-hpc make-tiny-model {path}`")
    missing = [f for f in ("config.json",) if not (path / f).is_file()]
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        missing.append("*.safetensors")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        missing.append("tokenizer.json")
    if missing:
        raise ModelNotFoundError(f"model.path: {path} is not a Hugging Face model directory (missing "
                                 f"{', '.join(missing)}); save one with `save_pretrained`, or fix model.path")
    return path
