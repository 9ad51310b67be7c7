"""The trainer on one GPU in bf16, measured: `scripts/gpu-check.sh` runs this (see there for wheels and --dry).

For each published Qwen3 shape asked for (default qwen3-1.7b and qwen3-4b), randomly initialised, and each recompute
setting (none, selective MLP): warm-up steps, then timed steps of
  SFT  the trainer's packed SFT step (`step.train_step` over `step.pack`): `--samples` random-token sequences of
       lengths in [seq_len/8, seq_len/2], token-mean NLL, AdamW, clipping;
  RL   the trainer's GRPO-RoC step on committed-shape trajectories (`rl.build_batch`: RoC, group advantages,
       packing; `rl.rl_step`: pi_old recomputed, the clipped loss, AdamW), 2G = 8 rollouts per prompt, G = 4 kept.
Figures per step kind: tokens/s (trained tokens), MFU (trainer/flops.py, as the trainer's perf/mfu: 3 passes for
the update, 1 more for the RL step's recompute, over the card's dense bf16 peak), and the peak memory from the
model's build on, beside `rstar-hpc train --plan`'s prediction for the same shape and layout. The last stdout line is one JSON
object of every figure, with the date, commit, card, torch, CUDA and driver versions; on a GPU it is also written to
docs/gpu-figures/DATE-CARD-COMMIT.json, where the planner reads its MFU per card (planner/gpu_figures.py). The first setting also runs one SFT and one RL step under torch.profiler: the top 10 kernels
by time, and how busy the GPU was. `--dry` runs the same steps on the CPU at a tiny shape (a check of the script, no
figures). On a GPU an untimed pass of the first setting comes first (see measure).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rstar_hpc.models.shapes import PUBLISHED, ModelShape  # noqa: E402
from rstar_hpc.trainer import flops  # noqa: E402

DRY_SHAPE = ModelShape(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=32)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="the same steps on the CPU at a tiny shape")
    ap.add_argument("--models", default="qwen3-1.7b,qwen3-4b",
                    help=f"published shapes to measure, in this order (of {', '.join(sorted(PUBLISHED))})")
    ap.add_argument("--seq-len", type=int, default=8192, help="micro-batch tokens (packed)")
    ap.add_argument("--samples", type=int, default=16, help="SFT sequences per step")
    ap.add_argument("--rl-prompts", type=int, default=8, help="RL prompts per step (8 rollouts each, 4 kept)")
    ap.add_argument("--rl-response-tokens", type=int, default=1500, help="mean response length of a rollout")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (torch.compile, allocator)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--peak-tflops", type=float, default=None, help="MFU denominator [by the GPU's name]")
    ap.add_argument("--recompute", default="none,selective", help="settings to measure, in this order")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="skip the torch.profiler pass (one SFT and one RL step of the first setting)")
    ap.add_argument("--commit", default=None, help="the commit measured, where the tree is no git checkout [git's]")
    ap.add_argument("--figures-dir", type=Path, default=None,
                    help="write the JSON there as DATE-CARD-COMMIT.json [docs/gpu-figures on a GPU; --dry: nowhere]")
    args = ap.parse_args()
    args.models = args.models.split(",")
    if unknown := [m for m in args.models if m not in PUBLISHED]:
        ap.error(f"--models: unknown shape {unknown}; published: {', '.join(sorted(PUBLISHED))}")
    if args.dry:
        args.seq_len, args.samples, args.rl_prompts, args.rl_response_tokens = 512, 4, 2, 120
        args.warmup, args.steps = 1, 1
    return args


def peak_tflops(args) -> float | None:
    if args.peak_tflops or args.dry:
        return args.peak_tflops
    return flops.peak_tflops(torch.cuda.get_device_name())


def driver_version() -> str | None:
    """The GPU driver's version, as nvidia-smi reports it (None without it)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def trainer_config(args, device: str, recompute: str):
    from rstar_hpc.config.trainer import TrainerConfig

    return TrainerConfig(backend=device, params_dtype="float32" if args.dry else "bfloat16",
                         micro_batch_tokens=args.seq_len, recompute=recompute, recompute_modules=["mlp"],
                         recompute_old_logprobs=True,
                         optimizer={"lr": 1e-5, "weight_decay": 0.0, "grad_clip": 1.0})


def planned_gib(shape: ModelShape, args, recompute: str) -> dict:
    """`rstar-hpc train --plan` for this shape on one GPU (tp = pp = dp = 1)."""
    from rstar_hpc.config import load_config
    from rstar_hpc.trainer.memory_plan import make_plan

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps({
            "model_type": shape.family, "vocab_size": shape.vocab_size, "hidden_size": shape.hidden_size,
            "intermediate_size": shape.intermediate_size, "num_hidden_layers": shape.num_layers,
            "num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim, "tie_word_embeddings": shape.tie_word_embeddings}))
        cfg = load_config("tiny-cpu", [f"model.path={d}", "launch.trainer.num_nodes=1",
                                       "launch.trainer.tasks_per_node=1", "trainer.use_distributed_optimizer=false",
                                       f"trainer.params_dtype={'float32' if args.dry else 'bfloat16'}",
                                       f"trainer.micro_batch_tokens={args.seq_len}", f"trainer.recompute={recompute}",
                                       "trainer.recompute_modules=[mlp]"])
        plan = make_plan(cfg)
    return {"total": round(plan.total_gib, 2), **plan.memory_gib}


def sft_batches(args, vocab: int) -> list[list]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(args.warmup + args.steps):
        lens = torch.randint(args.seq_len // 8, args.seq_len // 2 + 1, (args.samples,), generator=gen).tolist()
        out.append([(torch.randint(0, vocab, (n,), generator=gen), torch.arange(n) > 0) for n in lens])
    return out


def rl_tables(args, vocab: int) -> list:
    """Trajectory steps as the trainer reads them (exchange rows), tokens in the model's vocabulary."""
    from rstar_hpc.exchange.columns import to_table
    from rstar_hpc.synthetic.trajectories import make_step

    rng, out = np.random.default_rng(0), []
    for step in range(args.warmup + args.steps):
        trajs = make_step("gpu-check", "rl", step, args.rl_prompts, 8, mean_tokens=args.rl_response_tokens, seed=step,
                          text=False)
        for t in trajs:
            t.prompt_ids = np.asarray(t.prompt_ids[:256]) % vocab
            t.response_ids = np.asarray(t.response_ids[:args.seq_len - 256]) % vocab
            for name in ("loss_mask", "logprobs"):
                setattr(t, name, np.asarray(getattr(t, name))[:len(t.response_ids)])
            t.turns = [dataclasses.replace(t.turns[0], start=0, end=len(t.response_ids))]
            t.turns[0].role, t.tool_calls = "assistant", []
            t.reward = float(t.sample_index % 2 == 0 or rng.random() < 0.3)
        out.append(to_table(trajs))
    return out


def timed(args, steps: list, run, peak: float | None) -> dict:
    """Run `run(step) -> (trained seqlens, FLOP passes)` over `steps`; medians over the timed ones."""
    cuda = torch.cuda.is_available() and not args.dry
    times, tokens, done = [], [], []
    for i, item in enumerate(steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        seqlens, passes = run(item)
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            tokens.append(sum(seqlens))
            done.append(flops.model_flops(args.shape, seqlens, passes)[0])
    out = {"tokens_per_s": round(statistics.median(t / s for t, s in zip(tokens, times)), 1),
           "step_s": round(statistics.median(times), 3), "tokens_per_step": round(statistics.mean(tokens), 1)}
    if peak:
        out["mfu"] = round(statistics.median(flops.mfu(f, s, peak) for f, s in zip(done, times)), 4)
    return out


def check(args, device: str, recompute: str, peak: float | None, profile: bool = False) -> dict:
    """One recompute setting: build the policy, time SFT then RL steps, the peak memory over both; with `profile`,
    one more SFT and RL step each under torch.profiler."""
    from rstar_hpc.config.algo import AlgoConfig
    from rstar_hpc.trainer.arch import Arch
    from rstar_hpc.trainer.parallel import build_optimizer, build_policy
    from rstar_hpc.trainer.rl import build_batch, rl_step
    from rstar_hpc.trainer.step import pack, train_step

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    tcfg = trainer_config(args, device, recompute)
    algo = AlgoConfig(num_samples_per_prompt=8, roc={"down_sample_to_n": 4, "min_zero_reward_trace_num": 1,
                                                      "min_non_zero_reward_trace_num": 1})
    policy = build_policy(Arch(**vars(args.shape)), tcfg, device)
    opt = build_optimizer(policy, tcfg, 1e-5)

    def sft(batch):
        train_step(policy, opt, None, pack(batch, args.seq_len))
        return [len(ids) for ids, _ in batch], 3

    def rl(table):
        batch = build_batch(table, 0, algo, tcfg, run_seed=0)
        rl_step(policy, opt, None, batch, algo.loss, tcfg)
        lens = [len(ids) for ids, _ in batch.samples]
        return lens, 4   # the update, and pi_old recomputed
    sft_steps, rl_steps = sft_batches(args, args.shape.vocab_size), rl_tables(args, args.shape.vocab_size)
    out = {"sft": timed(args, sft_steps, sft, peak), "rl": timed(args, rl_steps, rl, peak),
           "planned_gib": planned_gib(args.shape, args, recompute)}
    if device == "cuda":
        out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if profile:
        out["profile"] = profiled(device, lambda: (sft(sft_steps[-1]), rl(rl_steps[-1])))
    return out   # the policy and optimizer go with this frame: the next setting starts from an empty GPU


def profiled(device: str, run) -> dict:
    """torch.profiler over `run()`: the 10 kernels (CPU: ops) with the most self time, their share of all kernel
    time, and how busy the device was over the wall time (low: the host is the bottleneck)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) * 1e6
    events = [e for e in prof.key_averages() if not cuda or e.device_type == DeviceType.CUDA]
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    total = sum(own(e) for e in events) or 1.0
    top = sorted(events, key=own, reverse=True)[:10]
    for e in top:
        print(f"gpu-check: profile {own(e) / 1e3:9.1f} ms {100 * own(e) / total:5.1f}%  {e.key[:110]}",
              file=sys.stderr, flush=True)
    # where the host's time goes: the optimizer's step, and the ops with the most host time of their own
    host = prof.key_averages()
    steps = [[e.key, round(e.cpu_time_total / 1e3, 1)] for e in host if e.key.startswith("Optimizer.")]
    host_top = [[e.key[:100], round(e.self_cpu_time_total / 1e3, 1), e.count]
                for e in sorted(host, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]]
    print(f"gpu-check: profile host {json.dumps(steps)} {json.dumps(host_top)}", file=sys.stderr, flush=True)
    return {"wall_ms": round(wall_us / 1e3, 1), "kernel_ms": round(total / 1e3, 1),
            "device_busy": round(total / wall_us, 3) if cuda else None,
            "top": [[e.key[:160], round(own(e) / 1e3, 2), round(own(e) / total, 4)] for e in top],
            "optimizer_host_ms": steps, "host_top": host_top}


def measure(args, device: str, peak: float | None) -> dict:
    """Every recompute setting of `args.shape`, after an untimed pass of the first one on a GPU."""
    settings = args.recompute.split(",")
    if device == "cuda":
        # an untimed pass first: on an H200 the first setting measured ran at ~40% of the same setting measured
        # again later, whichever it was (kernels compiled and autotuned), warm-up steps or not
        check(argparse.Namespace(**{**vars(args), "warmup": 1, "steps": 1}), device, settings[0], peak)
    figures = {}
    for i, recompute in enumerate(settings):
        figures[recompute] = check(args, device, recompute, peak, profile=args.profile and i == 0)
        brief = {k: v for k, v in figures[recompute].items() if k != "profile"}
        print(f"gpu-check: {args.name} recompute {recompute}: {json.dumps(brief)}", file=sys.stderr, flush=True)
    return figures


def main() -> None:
    args = parse_args()
    device = "cpu" if args.dry else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu-check: no CUDA device visible; --dry runs the same steps on the CPU")
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    from rstar_hpc.planner.gpu_figures import commit, write_figures
    from rstar_hpc.trainer.model import have_transformer_engine
    from rstar_hpc.trainer.parallel import destroy_distributed, init_distributed

    init_distributed(tp=1, backend=device)
    peak = peak_tflops(args)
    t0 = time.perf_counter()
    models = {}
    for name in ["dry"] if args.dry else args.models:
        args.name, args.shape = name, DRY_SHAPE if args.dry else PUBLISHED[name]
        models[name] = {"shape": dataclasses.asdict(args.shape), "params": flops.model_flops(args.shape, [1])[1],
                        **measure(args, device, peak)}
    destroy_distributed()
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (--dry)"
    out = {"check": "gpu", "date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": args.commit or commit(),
           "card": flops.card(name) if device == "cuda" else None, "device": name, "torch": torch.__version__,
           "cuda": torch.version.cuda, "driver": driver_version() if device == "cuda" else None,
           "seq_len": args.seq_len,
           "dtype": "float32" if args.dry else "bfloat16 (fp32 main weights)",
           "layer_spec": "transformer_engine" if device == "cuda" and have_transformer_engine() else "local+sdpa",
           "peak_tflops": peak, "wall_s": round(time.perf_counter() - t0, 1), "models": models}
    if args.figures_dir or device == "cuda":   # the figures as data: the planner reads its MFU per card from them
        print(f"gpu-check: figures written to {write_figures(out, args.figures_dir)}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
