"""One rank of the model-family test: `python family_worker.py HF_DIR OUT_DIR [EP]` with RANK/WORLD_SIZE/MASTER_PORT
set (tensor parallel = WORLD_SIZE / EP; EP, default 1: expert-parallel ranks, taken from data-parallel ones).

Loads HF_DIR into the trainer's policy, takes its full-vocabulary logits of `IDS`, trains one optimizer step,
takes them again and exports the trained policy to OUT_DIR/export; rank 0 saves both logits to OUT_DIR/logits.pt.
Run by test_families.py (tp 1 in its process, tp 2 as two processes), never collected by pytest (no test_ prefix).
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")


def ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(0))


def _full_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits over the whole (unpadded) vocabulary: the tensor-parallel ranks' shards gathered."""
    from megatron.core import parallel_state

    from rstar_hpc.trainer import host_device
    from rstar_hpc.trainer.model import forward_logits

    with torch.no_grad(), host_device.on_host():   # sequence parallelism's collectives (MoE at tp 2) assume CUDA
        shard = forward_logits(model, tokens)
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(shard) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim=-1)[..., : model.arch.vocab_size]


def run(hf_dir: str, out_dir: str) -> dict:
    from tests.helpers.tp_worker import fixed_batch
    from tests.helpers.trainer import make_optimizer, make_policy

    from rstar_hpc.trainer.hf_convert import export_hf_checkpoint
    from rstar_hpc.trainer.step import train_step

    policy = make_policy(Path(hf_dir))
    model = policy.single_module()
    tokens = ids(policy.arch.vocab_size)
    before = _full_logits(model.eval(), tokens)
    metrics = train_step(policy, make_optimizer(policy, lr=1e-2), None, fixed_batch(policy.arch.vocab_size))
    after = _full_logits(model.eval(), tokens)
    export_hf_checkpoint(policy, Path(out_dir) / "export", source_dir=hf_dir)
    return {"before": before, "after": after, "loss": metrics["loss"],
            "load_balancing_loss": metrics.get("train/moe_load_balancing_loss")}


if __name__ == "__main__":
    from rstar_hpc.trainer.parallel import destroy_distributed, init_distributed

    ep = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    init_distributed(tp=int(os.environ["WORLD_SIZE"]) // ep, ep=ep)
    result = run(sys.argv[1], sys.argv[2])
    if int(os.environ["RANK"]) == 0:
        torch.save(result, Path(sys.argv[2]) / "logits.pt")
    destroy_distributed()
