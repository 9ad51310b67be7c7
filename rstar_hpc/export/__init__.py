"""`rstar-hpc export`: any committed trainer checkpoint of a run as a Hugging Face model people can load.

    OUT/config.json, model(-0000i-of-0000n).safetensors (+ index)   the weights, TP/PP shards merged (weights.py)
    OUT/tokenizer files                                             with the training chat template (serving.py)
    OUT/generation_config.json                                      the recipe's sampling
    OUT/rstar_export.json                                           where it came from: run, stage, step

Which checkpoint: choose.py. Not to be confused with `rstar_hpc.exchange.export` (trajectory rows as files).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rstar_hpc.export.choose import Checkpoint, ExportError, find_checkpoint

PROVENANCE = "rstar_export.json"
__all__ = ["Checkpoint", "ExportError", "Exported", "export_checkpoint", "export_model", "find_checkpoint"]


@dataclass(frozen=True)
class Exported:
    out: Path
    checkpoint: Checkpoint
    generation: dict


def export_model(spec: str | os.PathLike, out: str | os.PathLike, *, stage: str | None = None,
                 step: int | None = None) -> Exported:
    """Export the checkpoint SPEC names (RUN or CKPT_DIR; the newest by default) to the new directory `out`."""
    return export_checkpoint(find_checkpoint(spec, stage, step), out)


def export_checkpoint(ckpt: Checkpoint, out: str | os.PathLike) -> Exported:
    """Written beside `out` and renamed into place: `out` is complete or absent, never half-written."""
    from rstar_hpc.config import load_config
    from rstar_hpc.export import serving
    from rstar_hpc.export.weights import write_hf_weights
    from rstar_hpc.models.resolve import resolve_model

    out = Path(out).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not empty; export into a new directory, or remove it first")
    if not ckpt.paths.config.is_file():
        raise ExportError(f"{ckpt.paths.dir} has no config.yaml (written when a run starts); the export needs the "
                          f"run's model and rollout settings from it")
    cfg = load_config(ckpt.paths.config)
    model_dir = resolve_model(cfg, build=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write_hf_weights(ckpt.dir, tmp, model_dir=model_dir, params_dtype=cfg.trainer.params_dtype,
                         max_shard_bytes=int(cfg.trainer.publish_max_shard_gb * 2**30))
        serving.write_tokenizer(tmp, model_dir, cfg)
        generation = serving.write_generation_config(tmp, model_dir, cfg, ckpt.stage)
        (tmp / PROVENANCE).write_text(json.dumps({
            "run": str(ckpt.paths.dir), "stage": ckpt.stage, "step": ckpt.step, "checkpoint": str(ckpt.dir),
            "base_model": str(model_dir), "exported_at": time.time()}, indent=2) + "\n")
        _readable(tmp)
        if out.exists():
            out.rmdir()   # empty (checked above)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(out, ckpt, generation)


def _readable(folder: Path) -> None:
    """The modes a plain `mkdir` and file write give (umask applied): mkdtemp's private 0700 would keep the model
    from everyone else who loads it from shared storage."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~umask)
