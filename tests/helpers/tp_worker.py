"""One rank of the tensor-parallel test: `python tp_worker.py HF_DIR OUT.pt` with RANK/WORLD_SIZE/MASTER_PORT set
(and KNOBS, trainer config knobs as JSON, e.g. {"sequence_parallel": true}).

Computes the loss and HF-layout gradients of `fixed_batch()`, then the losses of two optimizer steps, and (rank 0)
saves them. Run by test_tensor_parallel.py, never collected by pytest (no test_ prefix).
"""
from __future__ import annotations

import json
import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")


def fixed_batch(vocab: int) -> list:
    from rstar_hpc.trainer.step import pack

    gen = torch.Generator().manual_seed(7)
    samples = []
    for n in (9, 23, 14, 30, 5):
        ids = torch.randint(0, vocab, (n,), generator=gen)
        mask = torch.rand(n, generator=gen) < 0.7
        mask[0] = False
        samples.append((ids, mask))
    return pack(samples, token_budget=40)


def run(hf_dir: str, tp: int, **knobs) -> dict:
    from tests.helpers.trainer import make_optimizer, make_policy

    from rstar_hpc.trainer.hf_convert import gather_hf_state
    from rstar_hpc.trainer.parallel import init_distributed
    from rstar_hpc.trainer.step import forward_backward, train_step

    init_distributed(tp=tp)
    model = make_policy(hf_dir, **knobs)
    batch = fixed_batch(model.arch.vocab_size)
    first = forward_backward(model, batch)
    grads = gather_hf_state(model, grads=True)
    # grad_clip small enough to clip: the tensor-parallel norm must count replicated norms once
    opt = make_optimizer(model, lr=1e-2, grad_clip=0.5)
    losses = [train_step(model, opt, None, batch) for _ in range(3)]
    return {"loss": first["loss"], "grads": grads, "losses": [m["loss"] for m in losses],
            "grad_norms": [m["grad_norm"] for m in losses]}


if __name__ == "__main__":
    from rstar_hpc.trainer.parallel import destroy_distributed

    result = run(sys.argv[1], tp=int(os.environ["WORLD_SIZE"]), **json.loads(os.environ.get("KNOBS", "{}")))
    if int(os.environ["RANK"]) == 0:
        torch.save(result, sys.argv[2])
    destroy_distributed()
