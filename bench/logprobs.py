"""Token log-probabilities at the 14B output layer: the trainer's chunked path against the full-logits path.

Both take the same hidden states [tokens, 5120], output weight [151,936, 5120] and tokens (one packed sample), and
run forward and backward to the gradients of the hidden states and of the weight, the latter into the fp32 gradient
buffer training holds anyway (megatron DDP's `main_grad`):
  * full: the logits of the whole vocabulary (`F.linear`, what megatron's output layer computes), then
    `model.token_logprobs` (fp32 copy, megatron's `vocab_parallel_cross_entropy`, which keeps the fp32 softmax for
    its backward), the weight's gradient in the weight's dtype added to main_grad and freed (DDP's hook): the
    trainer's path before `trainer/logprobs.py`;
  * chunked: `logprobs.fused_loss`, chunks of `--chunk` tokens (trainer.logprob_chunk_tokens): per chunk the
    logits, softmax, log-probabilities, the loss and its gradients, the weight's added to main_grad in place;
    nothing kept for backward.
The loss is a sum over tokens of log p(token) with a random weight per token (an upstream gradient per token, as
the RL loss gives).
After one untimed pass of each (first-call allocations), the paths alternate on every repeat, each timed (wall
clock of forward + backward; the best repeat) and measured for its peak transient memory: the peak above what was
allocated before the pass (the inputs, the weight and main_grad), whatever was live at it. On the CPU the peak is the process's resident high-water mark (VmHWM, reset through /proc/self/clear_refs before each
pass; glibc maps tensors of this size with mmap and unmaps them when freed, so the resident set follows the
allocations); on CUDA, torch's peak allocated bytes.
The last stdout line is one JSON object: `peak_ratio` = full / chunked transient peak, `speed_ratio` = full time
/ chunked time (each path's best repeat; transient peaks are each path's largest, floored at 1 MiB, the CPU
measure's resolution), the relative difference of the two losses and the largest of the two weight gradients'
(over the rows of the first 256 targets, relative to its largest element).

    python bench/logprobs.py [--tokens 512] [--chunk 112] [--repeats 2]       # CPU, fp32
    python bench/logprobs.py --device cuda                                     # 8,192 tokens, bf16

--quick: a small output layer (a smoke test of the bench; the ratios say little).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time
import warnings

import torch

warnings.filterwarnings("ignore")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--tokens", type=int, default=None, help="default 512 on the CPU (fp32), 8192 on CUDA (bf16)")
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunk", type=int, default=None, help="tokens per chunk (trainer.logprob_chunk_tokens); "
                    "default 112 on the CPU (512 tokens: 5 chunks of ~102), the trainer's default on CUDA")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.hidden, args.vocab, args.repeats = args.tokens or 64, 256, 8000, 1
        args.chunk = args.chunk or 16
    args.tokens = args.tokens or (8192 if args.device == "cuda" else 512)
    return args


FLOOR = 2**20   # the CPU measure's resolution: small tensors come from malloc's arenas, not fresh mappings


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


class Peak:
    """Peak bytes allocated during a block above what was allocated when it started (see the module docstring)."""

    def __init__(self, device: str):
        self.device, self.bytes = device, 0

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")   # resets VmHWM to the current resident set
            self.base = _status("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self.base
        else:
            self.bytes = _status("VmHWM") - self.base


def _weighted_nll(logprobs, tokens, entropy):
    """The bench's loss: a SUM over tokens, each with its own upstream gradient (as the RL loss gives)."""
    return -(logprobs * tokens.extras["w"]).sum(), {}


def one_pass(path: str, hidden, weight, main_grad, mb, vocab: int, chunk: int) -> tuple[torch.Tensor, float, int]:
    """Forward + backward of one path; (loss, seconds, transient peak bytes)."""
    from rstar_hpc.trainer.logprobs import full_logits, fused_loss
    from rstar_hpc.trainer.model import token_logprobs

    weight.grad = hidden.grad = None
    main_grad.zero_()
    with Peak(hidden.device.type) as peak:
        t0 = time.perf_counter()
        if path == "full":   # position j predicts token j + 1
            lp = token_logprobs(full_logits(hidden, weight), torch.roll(mb.input_ids, -1)[None], vocab)
            loss = -(lp[0, :-1] * mb.extras["w"][1:]).sum()
            loss.backward()
            main_grad.add_(weight.grad)   # megatron DDP's hook, then the gradient is freed
            weight.grad = None
        else:
            weight.main_grad = main_grad
            loss = fused_loss(hidden, weight, mb, vocab, _weighted_nll, chunk)[0]
            loss.backward()
            del weight.main_grad
        if hidden.is_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    return loss.detach().float(), seconds, peak.bytes


def main() -> None:
    args = parse_args()
    from rstar_hpc.scratch import private_torch_cache

    private_torch_cache()   # before megatron imports torch._dynamo: its kernel cache goes at exit
    from rstar_hpc.trainer.logprobs import DEFAULT_CHUNK
    from rstar_hpc.trainer.packing import MicroBatch
    from rstar_hpc.trainer.parallel import destroy_distributed, init_distributed

    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    init_distributed(tp=1, backend=args.device)
    chunk = args.chunk or (DEFAULT_CHUNK if args.device == "cuda" else 112)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    try:
        hidden = torch.randn(1, args.tokens, args.hidden, generator=gen).to(args.device, dtype).requires_grad_()
        weight = (0.02 * torch.randn(args.vocab, args.hidden, generator=gen)).to(args.device, dtype).requires_grad_()
        ids = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
        w = torch.randn(args.tokens, generator=gen)
        w[0] = 0.0   # the first token has no prediction
        mb = MicroBatch(ids, [args.tokens], torch.zeros(args.tokens, dtype=torch.bool),
                        extras={"w": w}).to(args.device)
        main_grad = torch.ones(weight.shape, dtype=torch.float32, device=args.device)   # resident before any pass
        best = {"full": (float("inf"), 0), "chunked": (float("inf"), 0)}
        losses = {}
        rows, grads = ids[:256].unique().to(args.device), {}   # the targets' rows: where the gradient is largest
        for path in ("full", "chunked"):   # untimed: allocator and matmul buffers, first-call costs
            one_pass(path, hidden, weight, main_grad, mb, args.vocab, chunk)
            grads[path] = main_grad.index_select(0, rows).cpu()
        for r in range(args.repeats):
            for path in (("full", "chunked") if r % 2 == 0 else ("chunked", "full")):
                losses[path], seconds, peak = one_pass(path, hidden, weight, main_grad, mb, args.vocab, chunk)
                best[path] = (min(best[path][0], seconds), max(best[path][1], peak))
                print(f"{path:8s} repeat {r}: {seconds:.3f} s, transient peak {peak / 2**20:.1f} MiB", flush=True)
        for path, (seconds, peak) in best.items():
            print(f"{path:8s} best {seconds:.3f} s, transient peak {peak / 2**20:.1f} MiB")
        figures = {"bench": "logprobs", "device": args.device, "dtype": str(dtype).removeprefix("torch."),
                   "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "chunk": chunk,
                   "threads": torch.get_num_threads(),
                   "full_s": round(best["full"][0], 4), "chunked_s": round(best["chunked"][0], 4),
                   "full_peak_mib": round(best["full"][1] / 2**20, 1),
                   "chunked_peak_mib": round(best["chunked"][1] / 2**20, 1),
                   "peak_ratio": round(max(best["full"][1], FLOOR) / max(best["chunked"][1], FLOOR), 2),
                   "speed_ratio": round(best["full"][0] / best["chunked"][0], 3),
                   "loss_rel_diff": float((losses["full"] - losses["chunked"]).abs() / losses["full"].abs()),
                   "weight_grad_rel_diff": float((grads["full"] - grads["chunked"]).abs().max()
                                                 / grads["full"].abs().max())}
    finally:
        destroy_distributed()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
