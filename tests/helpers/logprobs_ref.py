"""The trainer's log-probabilities before trainer/logprobs.py, as the reference of its tests: full-vocabulary logits,
`model.token_logprobs` (megatron's vocab_parallel_cross_entropy), then the shift to token alignment. Also a test
case (hidden states, output weight, micro-batch) and an RL loss over it, shared by the in-process test and the
tensor-parallel worker (logprobs_tp_worker.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB, PADDED_VOCAB, HIDDEN = 397, 398, 24   # one padding row: on the second of two tensor-parallel ranks


def reference_aligned(hidden: torch.Tensor, weight: torch.Tensor, mb, vocab_size: int) -> torch.Tensor:
    """Token-aligned log-probabilities [T] (0 at sample starts) from all the logits at once."""
    from rstar_hpc.trainer.model import token_logprobs

    logits = F.linear(hidden, weight)
    if mb.padded_len is not None:
        return _aligned(token_logprobs(logits, torch.roll(mb.rows(), -1, dims=1), vocab_size), mb)
    return _aligned(token_logprobs(logits, torch.roll(mb.input_ids, -1)[None], vocab_size), mb)


def reference_entropy(hidden: torch.Tensor, weight: torch.Tensor, mb, vocab_size: int) -> torch.Tensor:
    """Token-aligned entropy [T] of each token's predicting distribution (0 at sample starts), padding rows out."""
    from rstar_hpc.algo.loss import entropy_from_logits

    return _aligned(entropy_from_logits(F.linear(hidden, weight)[..., :vocab_size]), mb)


def _aligned(per_row: torch.Tensor, mb) -> torch.Tensor:
    """[b, s] values of the rows that predict the next token -> token-aligned [T], 0 at sample starts."""
    if mb.padded_len is not None:
        shifted = torch.cat([per_row.new_zeros(per_row.size(0), 1), per_row[:, :-1]], dim=1)
        return torch.cat([shifted[r, :n] for r, n in enumerate(mb.seqlens)])
    out = torch.cat([per_row.new_zeros(1), per_row[0, :-1]])
    starts = torch.tensor([0] + list(mb.seqlens[:-1])).cumsum(0)
    return out.index_fill(0, starts, 0.0)


def case(padded: bool = False, seed: int = 3):
    """(hidden [b, s, HIDDEN], weight [PADDED_VOCAB, HIDDEN], micro-batch) with RL fields, fp32."""
    from rstar_hpc.trainer.packing import pack, pad

    gen = torch.Generator().manual_seed(seed)
    samples, adv, old = [], [], []
    for n in (7, 12, 1, 9):
        ids = torch.randint(0, VOCAB, (n,), generator=gen)
        mask = torch.rand(n, generator=gen) < 0.8
        mask[0] = False
        samples.append((ids, mask))
        adv.append(torch.randn(n, generator=gen))
        old.append(-torch.rand(n, generator=gen) * 6)
    mb = (pad(samples, 4, advantages=adv, old_logprobs=old) if padded else
          pack(samples, 64, advantages=adv, old_logprobs=old))[0]
    shape = (len(mb.seqlens), mb.padded_len) if padded else (1, mb.num_tokens)
    hidden = torch.randn(*shape, HIDDEN, generator=gen)
    weight = 0.3 * torch.randn(PADDED_VOCAB, HIDDEN, generator=gen)
    weight[VOCAB:] = 100.0   # padding rows that would dominate the softmax if they were counted
    return hidden, weight, mb


def rl_loss(logprobs: torch.Tensor, mb, entropy: torch.Tensor):
    """The GRPO-RoC loss as rl_step calls it (a sum), with its statistics (the entropy's sum among them)."""
    from rstar_hpc.algo.loss import policy_loss

    loss, stats = policy_loss(logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask, global_num_tokens=None,
                              entropy=entropy)
    return loss, {k: v for k, v in stats.items()}
