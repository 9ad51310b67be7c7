"""A trainer checkpoint's weights as Hugging Face safetensors, in one process on the host.

The checkpoint is megatron dist-checkpointing's: every tensor is saved with its global shape and each rank's
slice of it, whatever the tensor, pipeline and virtual-pipeline sizes were. So one process builds the whole model
(tensor and pipeline parallel 1), asks megatron to load its tensors from the checkpoint (it reads every saved
slice into the full tensors: the TP/PP merge), and writes them with the converter the published policies use
(`hf_convert.export_hf_checkpoint`). Only the model is read, not the optimizer's state. Memory: the model once,
in the trainer's parameter dtype (~28 GB for a 14B model in bf16).
"""
from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import torch
from megatron.core import dist_checkpointing, parallel_state

from rstar_hpc.export.choose import ExportError
from rstar_hpc.trainer import host_device
from rstar_hpc.trainer.checkpoint import FORMAT
from rstar_hpc.trainer.hf_convert import export_hf_checkpoint
from rstar_hpc.trainer.arch import Arch
from rstar_hpc.trainer.model import build_model
from rstar_hpc.trainer.parallel import destroy_distributed, init_distributed


@contextlib.contextmanager
def one_process_world():
    """A gloo world of this process alone (megatron builds and loads through process groups), torn down after;
    an existing world of one (tensor and pipeline parallel 1: a test session, a notebook) is used as it is."""
    if torch.distributed.is_initialized():
        layout = (torch.distributed.get_world_size(), parallel_state.get_tensor_model_parallel_world_size(),
                  parallel_state.get_pipeline_model_parallel_world_size())
        if layout != (1, 1, 1):
            raise RuntimeError(f"export runs in a process of its own; this one is in a world (size, tp, pp) = "
                               f"{layout}")
        yield
        return
    with tempfile.TemporaryDirectory(prefix="rstar-export-") as tmp:
        # a file store: no port to pick, nothing to collide with on a shared login node
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            init_distributed(tp=1, pp=1, backend="cpu")
            yield
        finally:
            destroy_distributed()


def write_hf_weights(ckpt_dir: Path, out: Path, *, model_dir: Path, params_dtype: str,
                     max_shard_bytes: int) -> None:
    """The model of the checkpoint at `ckpt_dir` as config.json + safetensors in `out` (`model_dir`: the run's
    Hugging Face model, for its architecture, config and tokenizer files)."""
    common = dist_checkpointing.load_common_state_dict(str(ckpt_dir))
    if common.get("format") != FORMAT:
        raise ExportError(f"{ckpt_dir}: format {common.get('format')!r}, expected {FORMAT!r}; not a trainer "
                          f"checkpoint of this version")
    arch = Arch.from_hf_config(model_dir)
    with one_process_world(), host_device.on_host():
        model = build_model(arch, backend="cpu", params_dtype=getattr(torch, params_dtype))
        loaded = dist_checkpointing.load(model.sharded_state_dict(), str(ckpt_dir))
        result = model.load_state_dict(loaded, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing:
            raise ExportError(f"{ckpt_dir}: no tensors for {missing[:5]}; the checkpoint is not of the model "
                              f"{model_dir}")
        export_hf_checkpoint(model, out, source_dir=model_dir, max_shard_bytes=max_shard_bytes)
