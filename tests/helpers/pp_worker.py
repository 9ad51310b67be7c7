"""One rank of the parallel-layout tests: `python pp_worker.py HF_DIR OUT.pt LAYOUT.json` (RANK, WORLD_SIZE set).

LAYOUT.json: {"tp": .., "pp": .., "vpp": .., "trainer": {knobs}, "save": DIR, "resume": DIR, "export": DIR}.
On the fixed batch (split over data-parallel ranks): the loss and HF-layout gradients of one forward/backward,
then three optimizer steps (losses, gradient norms, the weights after them); with `save`, a checkpoint after
step 2; with `resume`, a fresh policy loaded from that checkpoint takes step 3 again (`resumed_loss`); with `export`, the trained policy is written as a Hugging Face checkpoint. Rank 0
saves the results. Run by test_pipeline.py, never collected by pytest (no test_ prefix).
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")

LR = 1e-2


def fixed_batch(vocab: int, dp: int = 1, dp_rank: int = 0) -> list:
    """This data-parallel rank's micro-batches of a fixed step: 8 samples of mixed length, budget 48."""
    from rstar_hpc.trainer.step import pack

    gen = torch.Generator().manual_seed(7)
    samples = []
    for n in (9, 23, 14, 30, 5, 41, 17, 12):
        ids = torch.randint(0, vocab, (n,), generator=gen)
        mask = torch.rand(n, generator=gen) < 0.7
        mask[0] = False
        samples.append((ids, mask))
    return pack(samples[dp_rank::dp], token_budget=48)


def _policy(hf_dir: str, knobs: dict):
    from tests.helpers.trainer import make_optimizer, make_policy

    policy = make_policy(hf_dir, **knobs)
    return policy, make_optimizer(policy, lr=LR, grad_clip=0.5, **knobs)


def run(hf_dir: str, layout: dict) -> dict:
    from megatron.core import parallel_state

    from rstar_hpc.trainer.checkpoint import TrainState, load_checkpoint, save_checkpoint
    from rstar_hpc.trainer.hf_convert import export_hf_checkpoint, gather_hf_state
    from rstar_hpc.trainer.parallel import init_distributed
    from rstar_hpc.trainer.step import build_scheduler, forward_backward, train_step

    init_distributed(tp=layout.get("tp", 1), pp=layout.get("pp", 1), vpp=layout.get("vpp"))
    knobs = layout.get("trainer", {})
    policy, opt = _policy(hf_dir, knobs)
    batch = fixed_batch(policy.arch.vocab_size, parallel_state.get_data_parallel_world_size(),
                        parallel_state.get_data_parallel_rank())
    first = forward_backward(policy, batch)
    out = {"loss": first["loss"], "num_tokens": first["num_tokens"], "grads": gather_hf_state(policy, grads=True)}
    state = TrainState(policy, opt, build_scheduler(opt, 2, 10, "cosine"))
    steps = []
    for step in range(3):
        steps.append(train_step(policy, opt, state.scheduler, batch))
        state.step = step + 1
        if step == 1 and layout.get("save"):
            save_checkpoint(state, layout["save"])
            out["saved_weights"] = gather_hf_state(policy)   # what an export of that checkpoint must give
    out.update(losses=[m["loss"] for m in steps], grad_norms=[m["grad_norm"] for m in steps],
               weights=gather_hf_state(policy))
    if layout.get("export"):  # each stage writes its own safetensors files, the first one the index
        out["exported"] = str(export_hf_checkpoint(policy, layout["export"], source_dir=hf_dir, max_shard_bytes=2**20))
    if layout.get("resume"):
        policy, opt = _policy(hf_dir, knobs)
        state = TrainState(policy, opt, build_scheduler(opt, 2, 10, "cosine"))
        load_checkpoint(state, layout["resume"])
        out.update(resumed_step=state.step, resumed_loss=train_step(policy, opt, state.scheduler, batch)["loss"])
    return out


if __name__ == "__main__":
    from rstar_hpc.trainer.parallel import destroy_distributed

    result = run(sys.argv[1], json.loads(Path(sys.argv[3]).read_text()))
    if int(os.environ["RANK"]) == 0:
        torch.save(result, sys.argv[2])
    destroy_distributed()
