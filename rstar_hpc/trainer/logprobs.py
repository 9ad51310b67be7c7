"""Token log-probabilities and the loss from the last hidden states, never holding the full-vocabulary logits.

The policy's output layer (`HiddenOutputLayer`) returns its input, made ready for the vocab-parallel matmul, instead
of the logits. The trainer then goes over a micro-batch `trainer.logprob_chunk_tokens` tokens at a time: the
chunk's logits over this rank's vocabulary shard (fp32), its softmax in place of them, log p(target), and, for
the loss (`fused_loss`), the loss function on the chunk and the chunk's share of the gradients of the hidden states
and of the output weight. The transient memory is chunk x vocab/tp fp32 instead of tokens x vocab/tp (several
times: bf16 logits, their fp32 copy, the softmax kept for backward), for the same three matmuls of the output
layer: nothing is recomputed, because the loss functions are sums over tokens of a function of each token's
log-probability (step.LossFn), so a chunk's d loss / d log p is known as soon as its log-probabilities are. The
autograd backward only scales the gradients left by the forward by the schedule's output gradient.

Tensor parallel: the max, then the sum-exp with the target logit (contributed by the rank owning the target id)
are all-reduced over the tensor-parallel group, two small all-reduces per chunk. The hidden states' gradient of
each rank (its vocabulary shard's part) is all-reduced by megatron's `copy_to_tensor_model_parallel_region` (a
reduce-scatter after the gather with sequence parallelism), as the output layer's own backward would. Padded
vocabulary rows (Megatron pads to a multiple of the tensor-parallel size) are never computed, so the numbers are
the unpadded Hugging Face model's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from rstar_hpc.config.trainer import TrainerConfig

DEFAULT_CHUNK = TrainerConfig.model_fields["logprob_chunk_tokens"].default
ReduceOp = torch.distributed.ReduceOp


class HiddenOutputLayer(ColumnParallelLinear):
    """The output layer of a trainer-built GPTModel: returns the hidden states the logits matmul would take
    (gathered over the sequence with sequence parallelism; with the tensor-parallel backward all-reduce attached),
    so `GPTModel.forward` yields [b, s, hidden] on the last stage. Same parameters, state dict and checkpoints."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True,
                                                        group=self.tp_group), None
        if self.tp_group is not None and self.tp_group.size() > 1:
            return copy_to_tensor_model_parallel_region(input_, group=self.tp_group), None
        return input_, None


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP (or any `.module` wrapper)."""
    while not hasattr(model, "output_layer") and hasattr(model, "module"):
        model = model.module
    return model


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """This rank's shard of the output weight [vocab/tp, hidden] (the embedding when they are tied)."""
    model = unwrapped(model)
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def full_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The logits [..., vocab/tp] of the hidden states the policy returns (evaluation, tests: all of them at once)."""
    return F.linear(hidden, weight)



def _tp_group():
    return parallel_state.get_tensor_model_parallel_group() \
        if parallel_state.get_tensor_model_parallel_world_size() > 1 else None


def _vocab_range(weight: torch.Tensor, vocab_size: int, group) -> tuple[int, int]:
    """(first vocabulary id of this rank's shard, rows of it that are real, not padding)."""
    rows = weight.size(0)
    first = (group.rank() if group is not None else 0) * rows
    return first, max(0, min(rows, vocab_size - first))


_CPU_BLOCK_BYTES = 2 << 20


def _logits(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """w @ h.t() ([rows, c]). On the CPU in blocks of vocabulary rows whose output stays in cache (~2 MiB): one
    GEMM of a skinny [151,936, ~100] output re-streams it from memory for every panel of the hidden dimension;
    blocked, the chunked forward ran 1.16x faster on this project's 2-core CPU (fp32, 14B output layer)."""
    if w.device.type != "cpu" or w.size(0) * h.size(0) * w.element_size() <= 4 * _CPU_BLOCK_BYTES:
        return w @ h.t()   # a GPU, or a small vocabulary (the demo's): one call
    out = w.new_empty(w.size(0), h.size(0))
    rows = max(256, _CPU_BLOCK_BYTES // max(1, h.size(0) * w.element_size()))
    ht = h.t().contiguous()
    for a in range(0, w.size(0), rows):
        torch.mm(w[a:a + rows], ht, out=out[a:a + rows])
    return out


def _exp_and_sum_ez(z: torch.Tensor) -> torch.Tensor:
    """In place, z = logits - max [valid, c] becomes e = exp(z); returns per column sum(e * z) = sum(e log e), a
    sixteenth of the rows at a time (its temporaries stay small beside the chunk's buffer). No log: on the CPU,
    xlogy(e, e) over the vocabulary cost 4x the exponentials themselves (the demo's SFT step, vocabulary 1024)."""
    out = z.new_zeros(z.size(1))
    rows = max(1, -(-z.size(0) // 16))
    for a in range(0, z.size(0), rows):
        zb = z[a:a + rows]
        eb = torch.exp(zb)
        out += (eb * zb).sum(0)
        zb.copy_(eb)
    return out


def _chunk(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, first: int, valid: int, group,
           entropy: bool = False) -> tuple[torch.Tensor, ...]:
    """One chunk of c tokens: (exp(logits - max) [valid, c] in fp32, its sum over the whole vocabulary [c], local
    target row [c], target owned here [c], log p(target) [c], the entropy of each token's distribution [c] if
    `entropy`, else None); max, sum-exp, target logit and entropy sum over the tensor-parallel group.
    Entropy: H = -sum p log p = log S - sum(e z) / S with z = logits - max, e = exp(z) and S = sum e.
    Vocabulary-major ([valid, c], the weight first: on the CPU that matmul ran ~1.3x faster than [c, valid] at
    c = 96-104); the exponentials are made in place of the logits, one fp32 buffer."""
    logits = _logits(weight[:valid], h).float()
    local = targets - first
    mine = (local >= 0) & (local < valid)
    row = local.clamp(0, max(valid - 1, 0))
    tgt = torch.where(mine, logits.gather(0, row[None, :])[0], 0.0) if valid else logits.new_zeros(h.size(0))
    m = logits.amax(0) if valid else logits.new_full((h.size(0),), float("-inf"))
    if group is not None:
        torch.distributed.all_reduce(m, op=ReduceOp.MAX, group=group)
    z = logits.sub_(m[None, :])
    ent = _exp_and_sum_ez(z) if entropy else None   # sum(e log e) with e = exp(z), made in place
    exps = z if entropy else z.exp_()
    s = exps.sum(0)   # a rank holding only padding adds 0
    if group is not None:
        sums = torch.stack([s, tgt] + ([ent] if entropy else []))
        torch.distributed.all_reduce(sums, group=group)
        s, tgt, ent = sums[0], sums[1], (sums[2] if entropy else None)
    log_s = torch.log(s)
    return exps, s, row, mine, tgt - m - log_s, (log_s - ent / s if entropy else None)


def _bounds(tokens: int, chunk: int, unit: int = 8) -> list[tuple[int, int]]:
    """Chunks of at most `chunk` tokens, as even as possible (a short last chunk streams the whole weight through
    its matmuls for few tokens), cut at multiples of `unit`: on an H200 chunks of odd sizes ran their matmuls
    in cuBLAS's unaligned kernels (`align1`, 6.5% of the GPU's time at qwen3-1.7b)."""
    unit = unit if chunk >= unit else 1
    units = -(-tokens // unit)
    n = -(-units // (chunk // unit))
    cuts = [min(tokens, units * i // n * unit) for i in range(n + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def _aligned_rows(mb, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For token-aligned index i of `mb`: the row of the model's flattened output [b*s] that predicts token i, the
    token, and whether i starts a sample (no prediction: log-probability 0). Built on the host from seqlens."""
    starts = torch.zeros(mb.num_tokens, dtype=torch.bool)
    offsets = torch.tensor([0] + list(mb.seqlens[:-1])).cumsum(0)
    starts[offsets] = True
    if mb.padded_len is None:
        src = (torch.arange(mb.num_tokens) - 1).clamp(min=0)
    else:
        src = torch.cat([torch.arange(n) - 1 + r * mb.padded_len for r, n in enumerate(mb.seqlens)]).clamp(min=0)
    return src.to(device), mb.input_ids, starts.to(device)


@torch.no_grad()
def aligned_logprobs(hidden: torch.Tensor, weight: torch.Tensor, mb, vocab_size: int,
                     chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Token-aligned log-probabilities [T] of `mb` (0 at sample starts) from the policy's output [b, s, hidden]
    (either layout) and this rank's output-weight shard; chunks of `chunk` tokens, no gradient."""
    group = _tp_group()
    first, valid = _vocab_range(weight, vocab_size, group)
    src, targets, starts = _aligned_rows(mb, hidden.device)
    flat = hidden.reshape(-1, hidden.size(-1))
    out = torch.empty(mb.num_tokens, dtype=torch.float32, device=hidden.device)
    for a, b in _bounds(mb.num_tokens, chunk):
        out[a:b] = _chunk(flat.index_select(0, src[a:b]), weight, targets[a:b], first, valid, group)[4]
    return out.masked_fill_(starts, 0.0)


def _add_weight_grad(main: torch.Tensor, d32: torch.Tensor, d: torch.Tensor, h: torch.Tensor) -> None:
    """main += d @ h: a chunk's weight gradient into the gradient buffer (`main_grad`, fp32 unless
    grad_reduce_in_fp32 is off), with no weight-sized temporary, as megatron's gradient-accumulation fusion does."""
    if main.dtype == h.dtype:
        main.addmm_(d, h)
    elif main.is_cuda:   # bf16 operands, fp32 accumulation and output: one cuBLAS GEMM
        torch.addmm(main, d, h, out_dtype=main.dtype, out=main)
    else:   # no mixed-dtype GEMM on the CPU: the chunk's fp32 gradient, and its few hidden rows upcast
        main.addmm_(d32, h.to(main.dtype))


class _FusedLoss(torch.autograd.Function):
    """The loss SUM of a micro-batch from the policy's flattened output and the output weight; see
    `fused_loss`. The forward leaves the gradients, the backward scales them. A weight with megatron's gradient
    buffer (`main_grad`: the trainer's, under DDP) gets its gradient added there in the forward, chunk by chunk; the
    schedule's output gradient is then 1 (no loss scale: fp16 is no params_dtype, config.grad_scale_func is unset)."""

    @staticmethod
    def forward(ctx, flat, weight, mb, vocab_size: int, chunk: int, group, loss_fn, metrics: dict):
        first, valid = _vocab_range(weight, vocab_size, group)
        src, targets, starts = _aligned_rows(mb, flat.device)
        grad_h = torch.zeros_like(flat, dtype=torch.float32)
        main = getattr(weight, "main_grad", None) if ctx.needs_input_grad[1] else None
        grad_w = torch.empty_like(weight) if ctx.needs_input_grad[1] and main is None else None
        if grad_w is not None:
            grad_w[valid:].zero_()   # padding rows; the real ones are written by the first chunk
        total = flat.new_zeros((), dtype=torch.float32)
        for a, b in _bounds(mb.num_tokens, chunk):
            h = flat.index_select(0, src[a:b])
            exps, sums, row, mine, lp, ent = _chunk(h, weight, targets[a:b], first, valid, group, entropy=True)
            with torch.enable_grad():
                lp = lp.masked_fill(starts[a:b], 0.0).requires_grad_()
                loss, m = loss_fn(lp, mb.tokens(a, b), ent.masked_fill(starts[a:b], 0.0))
                g = torch.autograd.grad(loss, lp)[0] if loss.requires_grad else torch.zeros_like(lp)
            total += loss.detach().float()
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + v
            if not valid:
                continue
            # d loss / d logits = g * (onehot(target) - softmax), formed in place of the exponentials
            g = g.detach().float()
            d32 = exps.mul_((-g / sums)[None, :])
            d32.scatter_add_(0, row[None, :], torch.where(mine, g, 0.0)[None, :])
            d = d32.to(flat.dtype)
            w = weight[:valid]
            grad_h.index_add_(0, src[a:b], (w.t() @ d).t().float())
            if main is not None:
                _add_weight_grad(main[:valid], d32, d, h)
            elif grad_w is not None and a == 0:
                torch.mm(d, h, out=grad_w[:valid])
            elif grad_w is not None:
                grad_w[:valid].addmm_(d, h)
            del exps, d32, d   # before the next chunk's logits: one chunk buffer at a time
        ctx.grads = (grad_h.to(flat.dtype), grad_w)
        ctx.weight = weight if main is not None else None
        return total

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w = ctx.grads
        weight, ctx.grads, ctx.weight = ctx.weight, None, None
        if weight is not None and grad.device.type == "cpu" and float(grad) != 1.0:
            raise RuntimeError(f"a loss scale ({float(grad)}) on the fused loss, whose weight gradient went into "
                               f"main_grad unscaled in the forward")
        if grad.device.type != "cpu" or float(grad) != 1.0:   # the schedule's scale: 1 unless a loss scale applies
            grad_h = grad_h * grad.to(grad_h.dtype)
            grad_w = grad_w.mul_(grad.to(grad_w.dtype)) if grad_w is not None else None
        if weight is not None and getattr(weight, "overlap_grad_reduce", False) and \
                not getattr(weight, "zero_out_wgrad", False):
            # DDP's hook launches the bucket's overlapped reduce when the weight's gradient arrives: megatron's
            # unread dummy, flagged as added already. A tied weight (zero_out_wgrad) needs none: the embedding's
            # own gradient runs the hook, which adds it to main_grad.
            grad_w = torch.empty_like(weight)
            weight.grad_added_to_main_grad = True
        return grad_h, grad_w, None, None, None, None, None, None


def fused_loss(hidden: torch.Tensor, weight: torch.Tensor, mb, vocab_size: int, loss_fn,
               chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, dict]:
    """`loss_fn` (step.LossFn: a SUM over tokens) of micro-batch `mb`, from the policy's output [b, s, hidden] and
    this rank's output-weight shard, chunks of `chunk` tokens; returns (loss, the chunks' metrics added up).

    The loss functions are sums over tokens of a function of each token's log-probability, so each chunk's
    d loss / d log p is known as soon as its log-probabilities are: the forward computes the chunk's logits once,
    and its gradients with them (three matmuls of the output layer, as with full logits; none recomputed). `loss_fn`
    sees the chunk's log-probabilities, `mb.tokens(a, b)` and each token's entropy (a statistic: no gradient goes
    through it)."""
    metrics: dict = {}
    loss = _FusedLoss.apply(hidden.reshape(-1, hidden.size(-1)), weight, mb, vocab_size, max(1, int(chunk)),
                            _tp_group(), loss_fn, metrics)
    return loss, metrics
