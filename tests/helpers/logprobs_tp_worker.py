"""One rank of the chunked log-probabilities test at tensor parallel 2: `python logprobs_tp_worker.py OUT.pt` with
RANK/WORLD_SIZE/MASTER_PORT set. Each rank holds half of the output weight's rows (the second half ends in a
padding row); rank 0 saves the log-probabilities, the loss, its statistics and the gradients of the hidden states
and of the whole weight (gathered), for both layouts. Run by test_logprobs.py, never collected by pytest."""
from __future__ import annotations

import sys
import warnings

import torch

warnings.filterwarnings("ignore")


def run(chunk: int) -> dict:
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
    from tests.helpers.logprobs_ref import VOCAB, case, rl_loss

    from rstar_hpc.trainer.logprobs import aligned_logprobs, fused_loss

    rank = torch.distributed.get_rank()
    out = {}
    for padded in (False, True):
        hidden, weight, mb = case(padded)
        rows = weight.size(0) // 2
        h = hidden.clone().requires_grad_()
        w = weight[rank * rows:(rank + 1) * rows].clone().requires_grad_()
        ready = copy_to_tensor_model_parallel_region(h)   # what HiddenOutputLayer hands over
        loss, metrics = fused_loss(ready, w, mb, VOCAB, rl_loss, chunk)
        loss.backward()
        parts = [torch.empty_like(w.grad) for _ in range(2)]
        torch.distributed.all_gather(parts, w.grad)
        out[padded] = {"lp": aligned_logprobs(h.detach(), w.detach(), mb, VOCAB, chunk), "loss": loss.detach(),
                       "metrics": metrics, "hidden_grad": h.grad, "weight_grad": torch.cat(parts)}
    return out


if __name__ == "__main__":
    from rstar_hpc.trainer.parallel import destroy_distributed, init_distributed

    init_distributed(tp=2)
    result = run(chunk=5)
    if torch.distributed.get_rank() == 0:
        torch.save(result, sys.argv[1])
    destroy_distributed()
