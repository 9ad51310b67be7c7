"""Micro-batches of variable-length samples: token-budget packing (THD), and padding as the baseline.

A `MicroBatch` is a step's unit of forward/backward. Its per-token fields are flat and aligned with the
concatenated samples, whatever the layout: `loss_mask[i]` says token i is trained; `logprobs[i] = log p(token i |
earlier tokens of its sample)`, so the first token of each sample never has a logprob (its mask must be 0). RL adds
`advantages` and `old_logprobs` (the engine's or recomputed) with the same alignment.

Two layouts reach the model:
  * packed (`pack`, the trainer's): one row of concatenated samples of at most `token_budget` tokens, attention
    kept within each sample (`PackedSeqParams`, THD). A step of 500- and 12K-token trajectories costs its tokens.
  * padded (`pad`, the classic fixed-shape batch, kept as the bench's baseline and the packing test's reference):
    `padded_len` set, each sample one row right-padded to it, causal attention (padding comes after every real
    token, so it changes nothing the loss sees).
`pad_to_length` and `round_up_count` serve the interleaved pipeline schedule, which is run with one activation
shape and needs a micro-batch count that is a multiple of the pipeline size: fillers carry no trained token.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

PER_TOKEN = ("loss_mask", "advantages", "old_logprobs")


@dataclass
class TokenSlice:
    """Consecutive tokens of a micro-batch: its per-token fields, sliced (views)."""

    loss_mask: torch.Tensor
    advantages: torch.Tensor | None
    old_logprobs: torch.Tensor | None
    extras: dict[str, torch.Tensor]


@dataclass
class MicroBatch:
    input_ids: torch.Tensor                        # [T] long, samples concatenated
    seqlens: list[int]                             # sample lengths, sum = T
    loss_mask: torch.Tensor                        # [T] bool: token i is trained
    advantages: torch.Tensor | None = None         # [T] float (RL)
    old_logprobs: torch.Tensor | None = None       # [T] float (RL)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    padded_len: int | None = None                  # padded layout: each sample a row of this many tokens

    def __post_init__(self) -> None:
        t = self.input_ids.numel()
        if sum(self.seqlens) != t:
            raise ValueError(f"seqlens sum to {sum(self.seqlens)} but the micro-batch has {t} tokens")
        for name in PER_TOKEN:
            v = getattr(self, name)
            if v is not None and v.shape != (t,):
                raise ValueError(f"{name} has shape {tuple(v.shape)}, expected ({t},) aligned with input_ids")
        starts = torch.tensor([0] + list(self.seqlens[:-1])).cumsum(0)
        if self.loss_mask[starts].any():
            raise ValueError("loss_mask is set on the first token of a sample, which has no prediction; "
                             "mask prompts (at least their first token) out")
        if self.padded_len is not None and max(self.seqlens) > self.padded_len:
            raise ValueError(f"a sample of {max(self.seqlens)} tokens does not fit rows of {self.padded_len}")

    @property
    def num_tokens(self) -> int:
        """Real tokens (padding excluded)."""
        return self.input_ids.numel()

    @property
    def num_slots(self) -> int:
        """Token positions the model computes: real tokens, or rows x padded_len."""
        return self.num_tokens if self.padded_len is None else len(self.seqlens) * self.padded_len

    @property
    def num_trained(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device: torch.device | str) -> MicroBatch:
        """The same micro-batch on `device`, not validated again (on a GPU that would wait for the copy)."""
        def move(x):
            return None if x is None else x.to(device)
        out = copy.copy(self)
        for name in ("input_ids", "loss_mask", *PER_TOKEN[1:]):
            setattr(out, name, move(getattr(self, name)))
        out.extras = {k: move(v) for k, v in self.extras.items()}
        return out

    def tokens(self, a: int, b: int) -> TokenSlice:
        """The per-token fields of tokens [a, b): what a loss function reads, chunk by chunk (trainer/logprobs.py)."""
        def cut(x):
            return None if x is None else x[a:b]
        return TokenSlice(self.loss_mask[a:b], cut(self.advantages), cut(self.old_logprobs),
                          {k: v[a:b] for k, v in self.extras.items()})

    def rows(self) -> torch.Tensor:
        """Padded layout: input ids as [rows, padded_len] (padding id 0)."""
        out = self.input_ids.new_zeros(len(self.seqlens), self.padded_len)
        for r, ids in enumerate(self.input_ids.split(self.seqlens)):
            out[r, : ids.numel()] = ids
        return out


def _assemble(samples: list, extra: dict[str, list], idx: list[int], padded_len: int | None = None) -> MicroBatch:
    fields = {k: torch.cat([v[i] for i in idx]) for k, v in extra.items()}
    return MicroBatch(input_ids=torch.cat([samples[i][0] for i in idx]),
                      seqlens=[samples[i][0].numel() for i in idx],
                      loss_mask=torch.cat([samples[i][1] for i in idx]).bool(),
                      advantages=fields.pop("advantages", None), old_logprobs=fields.pop("old_logprobs", None),
                      extras=fields, padded_len=padded_len)


def pack(samples: Iterable[tuple[torch.Tensor, torch.Tensor]], token_budget: int,
         **per_token: Iterable[torch.Tensor]) -> list[MicroBatch]:
    """Greedy first-fit packing of (input_ids, loss_mask) samples into micro-batches of <= token_budget tokens.

    `per_token` names optional aligned lists (`advantages=[...]`, `old_logprobs=[...]`). Order is kept within
    a micro-batch; a sample longer than the budget is an error (raise the budget or truncate upstream).
    """
    samples = list(samples)
    extra = {k: list(v) for k, v in per_token.items()}
    bins: list[list[int]] = []
    used: list[int] = []
    for i, (ids, _) in enumerate(samples):
        n = ids.numel()
        if n > token_budget:
            raise ValueError(f"sample {i} has {n} tokens, more than trainer.micro_batch_tokens={token_budget}")
        for b, u in enumerate(used):
            if u + n <= token_budget:
                bins[b].append(i)
                used[b] += n
                break
        else:
            bins.append([i])
            used.append(n)
    return [_assemble(samples, extra, b) for b in bins]


def pad(samples: Iterable[tuple[torch.Tensor, torch.Tensor]], rows_per_micro_batch: int,
        padded_len: int | None = None, **per_token: Iterable[torch.Tensor]) -> list[MicroBatch]:
    """The fixed-shape baseline: micro-batches of `rows_per_micro_batch` samples in order, every row padded to
    `padded_len` (default: the longest sample of the step, as a fixed sequence length does)."""
    samples = list(samples)
    extra = {k: list(v) for k, v in per_token.items()}
    length = padded_len or max(ids.numel() for ids, _ in samples)
    return [_assemble(samples, extra, list(range(i, min(i + rows_per_micro_batch, len(samples)))), length)
            for i in range(0, len(samples), rows_per_micro_batch)]


def pad_to_length(mb: MicroBatch, length: int) -> MicroBatch:
    """A packed micro-batch grown to exactly `length` tokens by one untrained filler sample (ids 0)."""
    n = length - mb.num_tokens
    if n < 0:
        raise ValueError(f"micro-batch of {mb.num_tokens} tokens is longer than {length}")
    if n == 0:
        return mb

    def grow(x, fill):
        return None if x is None else torch.cat([x, x.new_full((n,), fill)])
    return MicroBatch(grow(mb.input_ids, 0), mb.seqlens + [n], grow(mb.loss_mask, False), grow(mb.advantages, 0.0),
                      grow(mb.old_logprobs, 0.0), {k: grow(v, 0) for k, v in mb.extras.items()})


def round_up_count(mbs: list[MicroBatch], multiple: int, length: int = 1) -> list[MicroBatch]:
    """Append filler micro-batches of `length` tokens (nothing trained) until the count is a multiple of
    `multiple`."""
    out = list(mbs)
    like = mbs[0]
    while len(out) % multiple:
        ids = torch.zeros(length, dtype=like.input_ids.dtype)
        out.append(MicroBatch(ids, [length], torch.zeros(length, dtype=torch.bool),
                              None if like.advantages is None else torch.zeros(length),
                              None if like.old_logprobs is None else torch.zeros(length)))
    return out
