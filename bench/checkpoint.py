"""How long the training loop blocks on a checkpoint: synchronous saves against async ones (trainer.checkpoint.async_save).

One trainer rank (the trainer's own policy, optimizer and `trainer/checkpoint.Checkpointer`, as `rstar-hpc train`
runs them) trains a step, then saves, `--saves` times per mode, alternating which mode goes first. Sync: the save
call's seconds (what the loop waits for). Async: the save call's seconds (planning, the device-to-host copy, the
fork of the writer) plus the next step's non-blocking finalize, and separately the write's whole duration
(`time/checkpoint_async(s)`, save to commit). A checkpoint holds the bf16 weights, fp32 main weights and two AdamW
moments (~14 bytes per parameter). The last stdout line is one JSON object of the figures; `blocked_ratio` is async
blocked / sync blocked, measured in the same run.

    python bench/checkpoint.py --device cuda --model qwen3-0.6b [--saves 3] [--dir /lustre/...]
    python bench/checkpoint.py --quick        # a toy shape on the CPU: a smoke test, the figures say little

Scratch (the checkpoints, without --dir) goes under $TMPDIR and is removed at the end, failure or not; --keep keeps
it and prints its path on stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import warnings

import torch

warnings.filterwarnings("ignore")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", default="qwen3-0.6b", help="a published Qwen3 shape (rstar_hpc.models.shapes)")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the published shape")
    p.add_argument("--saves", type=int, default=3, help="timed saves per mode (after one untimed warm-up save)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the step trained between saves")
    p.add_argument("--dir", default=None, help="where checkpoints go, left there (default: a scratch directory "
                   "under $TMPDIR, removed at the end)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (its path goes to stderr)")
    p.add_argument("--quick", action="store_true", help="a toy shape, 2 saves: a smoke test")
    return p.parse_args()


def _arch(args):
    from rstar_hpc.models.shapes import PUBLISHED
    from rstar_hpc.trainer.arch import Arch

    if args.quick:
        return Arch(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)
    s = PUBLISHED[args.model]
    return Arch(**{**vars(s), "num_layers": args.layers or s.num_layers})


def main() -> None:
    args = parse_args()
    from rstar_hpc.scratch import private_torch_cache

    private_torch_cache()   # before megatron/vLLM import torch._dynamo: its kernel cache goes at exit
    from rstar_hpc.scratch import scratch_dir

    with contextlib.ExitStack() as stack:   # the scratch directory is removed at the end, failure or not
        root = args.dir or str(stack.enter_context(scratch_dir("bench-ckpt-", keep=args.keep)))
        out = bench(args, root)
    print(json.dumps(out))


def bench(args, root: str) -> dict:
    if args.quick:
        args.saves, args.tokens = 2, 128
    from rstar_hpc.config.trainer import TrainerConfig
    from rstar_hpc.trainer.checkpoint import TrainState
    from rstar_hpc.trainer.checkpoint import Checkpointer
    from rstar_hpc.trainer.parallel import build_optimizer, build_policy, destroy_distributed, init_distributed
    from rstar_hpc.trainer.step import pack, train_step

    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    init_distributed(tp=1, backend=args.device)
    arch = _arch(args)
    tcfg = TrainerConfig(backend=args.device, params_dtype="bfloat16" if args.device == "cuda" else "float32",
                         micro_batch_tokens=args.tokens, optimizer={"lr": 1e-5, "weight_decay": 0.0})
    policy = build_policy(arch, tcfg, args.device)
    opt = build_optimizer(policy, tcfg, 1e-5)
    state = TrainState(policy, opt, None)
    params = sum(p.numel() for p in policy.parameters())
    gen = torch.Generator().manual_seed(0)
    sample = torch.randint(0, arch.vocab_size, (args.tokens,), generator=gen)
    mask = torch.ones(args.tokens, dtype=torch.bool)
    mask[0] = False   # the first token has no prediction
    batch = [(sample, mask)]

    def sync_wait():
        if args.device == "cuda":
            torch.cuda.synchronize()

    ckpts = {m: Checkpointer(os.path.join(root, m), async_save=(m == "async"), keep_last=1) for m in ("sync", "async")}
    blocked: dict[str, list[float]] = {"sync": [], "async": []}
    train_s: list[float] = []
    for i in range(args.saves + 1):   # save 0 warms up (the fork's first queue, file system caches)
        for mode in (("sync", "async") if i % 2 else ("async", "sync")):
            ckpt = ckpts[mode]
            t0 = time.perf_counter()
            train_step(policy, opt, None, pack(batch, args.tokens))
            sync_wait()
            t1 = time.perf_counter()
            ckpt.finalize()   # the loop's per-step, non-blocking finalize of an earlier async save
            state.step += 1
            ckpt.save(state)
            sync_wait()
            if i:
                train_s.append(t1 - t0)
                blocked[mode].append(time.perf_counter() - t1)
    for ckpt in ckpts.values():
        ckpt.close()   # waits for the last async write and commits it
    write_s = ckpts["async"].async_seconds[1:] or ckpts["async"].async_seconds
    destroy_distributed()
    sync_b, async_b = statistics.median(blocked["sync"]), statistics.median(blocked["async"])
    out = {"bench": "checkpoint", "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "model": "toy" if args.quick else args.model, "layers": arch.num_layers, "params": params,
           "checkpoint_gb": round(14 * params / 1e9, 3), "saves": args.saves,
           "train_step_s": round(statistics.median(train_s), 4), "sync_blocked_s": round(sync_b, 4),
           "async_blocked_s": round(async_b, 4), "async_write_s": round(statistics.median(write_s), 4),
           "blocked_ratio": round(async_b / sync_b, 3) if sync_b else None}
    return out


if __name__ == "__main__":
    main()
