"""Tokens/s of trainer steps on the CPU: the Megatron policy vs plain PyTorch, and packing vs padding.

SFT step: the trainer's policy (megatron-core DDP, optimizer and schedule, as `rstar-hpc train` runs it) and Hugging
Face `Qwen3ForCausalLM` start from the same tiny checkpoint, take the same samples and the same token-mean masked
NLL with AdamW and clipping. The reference runs each sample as its own unpadded sequence (plain HF packs nothing).
RL step: synthetic trajectory steps (paper-shaped: prompt, model turns, masked tool turns) are committed with
the exchange's ShardWriter; the trainer's path reads them (RoC, group advantages, packing) and runs `rl_step`:
pi_old recomputed with the trainer, the GRPO-RoC loss (`rstar_hpc.algo.policy_loss`) normalised by the step's
trained tokens, AdamW, clipping. The reference runs the same kept samples through the same recompute, the same
loss function and the same optimizer. Reading the shards is timed separately (`rl_read_s_per_step`).
Packing vs padding: one mixed-length step, as the paper's (many ~500-token trajectories and a few ~12K-token ones,
here scaled to the tiny model: `--mix-short` samples of `--short-tokens` and `--mix-long` of `--long-tokens`),
trained by the same trainer twice: packed into micro-batches of `--pack-tokens` (THD, the trainer's way) and padded
to the step's longest sample (rows per micro-batch = pack-tokens // longest, at least 1: the classic fixed-shape
batch). Both count real tokens only; `packing_ratio` = packed / padded tokens/s, measured in the same run.
Every comparison alternates which side goes first on every step (`interleaved`). The last stdout line is one JSON
object of the figures.

    python bench/trainer.py [--steps 7] [--samples 16] [--tokens 1024] [--rl-prompts 4] [--rl-response-tokens 300]
                            [--mix-short 28] [--short-tokens 64] [--mix-long 4] [--long-tokens 1536] [--pack-tokens 2048]

--quick: one timed step of each comparison at toy sizes (a smoke test of the bench; the ratios say little).
--keep: keep the scratch directory (the tiny model, SFT data, the RL run directory; under $TMPDIR) that is otherwise
removed at the end, failure or not; its path goes to stderr.

Realistic sizes (`--model qwen3-0.6b|qwen3-1.7b|qwen3-4b|...`, usually `--device cuda`): the SFT step only, on a
Qwen3-architecture model of that published shape built from its config (random init, bf16 weights with fp32 main
weights: what `trainer.params_dtype: bfloat16` trains), packed micro-batches of `--seq-len` tokens; see
bench/trainer_sized.py (MFU, peak memory).

    python bench/trainer.py --device cuda --model qwen3-1.7b --seq-len 8192 --samples 16 --steps 4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import torch

warnings.filterwarnings("ignore")


def interleaved(a, b, batches) -> tuple[tuple[float, list[float]], tuple[float, list[float]]]:
    """Run `a` and `b` (step functions returning (loss, tokens)) on every batch, alternating which goes first,
    and return each one's median tokens/s over the timed steps and its losses: on a shared, loaded machine both
    see the same contention, which back-to-back runs of one then the other do not."""
    out = {a: ([], []), b: ([], [])}
    for i, batch in enumerate(batches):
        for fn in ((a, b) if i % 2 else (b, a)):
            t0 = time.perf_counter()
            loss, tokens = fn(batch)
            if i:  # the first batch warms up (allocator, kernels), untimed
                out[fn][0].append(tokens / (time.perf_counter() - t0))
            out[fn][1].append(loss)
    return tuple((statistics.median(tps), losses) for tps, losses in (out[a], out[b]))  # type: ignore[return-value]


def trainer_policy(model_dir, lr: float):
    """The trainer's policy and optimizer on one CPU rank (what `rstar-hpc train` builds), no weight decay."""
    from rstar_hpc.config.trainer import TrainerConfig
    from rstar_hpc.trainer.hf_convert import load_hf_checkpoint
    from rstar_hpc.trainer.arch import Arch
    from rstar_hpc.trainer.parallel import build_optimizer, build_policy

    tcfg = TrainerConfig(backend="cpu", optimizer={"lr": lr, "weight_decay": 0.0, "grad_clip": 1.0})
    policy = build_policy(Arch.from_hf_config(model_dir), tcfg, "cpu")
    load_hf_checkpoint(policy, model_dir)
    return policy, build_optimizer(policy, tcfg, lr)


def parse_args() -> argparse.Namespace:
    from rstar_hpc.models.shapes import PUBLISHED

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=7, help="timed steps (plus one warm-up)")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1024, help="micro-batch token budget")
    ap.add_argument("--rl-prompts", type=int, default=4, help="prompts per RL step (8 rollouts each, RoC keeps 4)")
    ap.add_argument("--rl-response-tokens", type=int, default=300, help="mean response length of a rollout")
    ap.add_argument("--mix-short", type=int, default=28, help="packing vs padding: short samples per step")
    ap.add_argument("--short-tokens", type=int, default=64)
    ap.add_argument("--mix-long", type=int, default=4, help="packing vs padding: long samples per step")
    ap.add_argument("--long-tokens", type=int, default=1536)
    ap.add_argument("--pack-tokens", type=int, default=2048, help="packing vs padding: micro-batch token budget")
    qwen3 = [k for k, s in PUBLISHED.items() if s.family == "qwen3"]   # the sized bench builds Qwen3
    ap.add_argument("--model", default="tiny", choices=["tiny", *qwen3],
                    help="tiny: the CPU comparisons; else the SFT step at that Qwen3 shape (bench/trainer_sized.py)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="for the sized models")
    ap.add_argument("--seq-len", type=int, default=8192, help="sized models: tokens per packed micro-batch")
    ap.add_argument("--layers", type=int, default=None, help="sized models: fewer layers (smoke tests)")
    ap.add_argument("--warmup", type=int, default=2, help="sized models: untimed steps first (compilation)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="MFU denominator (H100 SXM dense bf16)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (tiny model, SFT data) under "
                    "$TMPDIR instead of removing it at the end; its path goes to stderr")
    ap.add_argument("--quick", action="store_true", help="toy sizes, one timed step (smoke test); explicit flags "
                    "still win")
    args = ap.parse_args()
    if args.quick:
        ap.set_defaults(steps=1, samples=4, tokens=512, rl_prompts=2, rl_response_tokens=100, mix_short=6,
                        short_tokens=32, mix_long=1, long_tokens=256, pack_tokens=512, seq_len=512, layers=1,
                        warmup=1)
        args = ap.parse_args()
    if args.model == "tiny" and args.device != "cpu":
        ap.error("--model tiny runs on the CPU; pick a sized --model for --device cuda")
    return args


def main() -> None:
    args = parse_args()
    from rstar_hpc.scratch import private_torch_cache

    private_torch_cache()   # before megatron/vLLM import torch._dynamo: its kernel cache goes at exit
    if args.model != "tiny":
        from trainer_sized import bench_sized  # bench/ is on sys.path when this file runs as a script

        print(json.dumps(bench_sized(args)))
        return
    from rstar_hpc.config.run import TinyModelSpec
    from rstar_hpc.models.tiny import make_tiny_model
    from rstar_hpc.trainer.parallel import destroy_distributed, init_distributed

    from rstar_hpc.scratch import scratch_dir

    with scratch_dir("bench-trainer-", keep=args.keep) as scratch:   # removed at the end, failure or not
        tmp = str(scratch)
        model_dir = make_tiny_model(os.path.join(tmp, "tiny"), TinyModelSpec())
        for k, v in (("RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(k, v)
        init_distributed(tp=1)
        try:
            figures = {"bench": "trainer_step", "device": "cpu", "threads": torch.get_num_threads(),
                       "steps": args.steps}
            figures.update(bench_sft(args, model_dir, tmp))
            figures.update(bench_rl(args, model_dir, tmp))
            figures.update(bench_packing(args, model_dir))
        finally:
            destroy_distributed()
    print(json.dumps(figures))


def bench_sft(args, model_dir, tmp: str) -> dict:
    """The SFT step vs Hugging Face (see the module docstring); needs the process group of main()."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from rstar_hpc.trainer.sft import SFTData
    from rstar_hpc.synthetic.sft_chats import make_samples, write_jsonl
    from rstar_hpc.trainer.step import pack, train_step

    data = write_jsonl(make_samples(args.samples * (args.steps + 1), seed=0, system=""), os.path.join(tmp, "d.jsonl"))
    samples = SFTData.from_jsonl(data, AutoTokenizer.from_pretrained(model_dir)).samples
    batches = [samples[i * args.samples:(i + 1) * args.samples] for i in range(args.steps + 1)]
    meg, meg_opt = trainer_policy(model_dir, lr=1e-3)
    ref = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref.train()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)

    def ref_step(batch) -> tuple[float, int]:
        ref_opt.zero_grad(set_to_none=True)
        n = sum(int(m.sum()) for _, m in batch)
        total = 0.0
        for ids, mask in batch:
            lp = torch.log_softmax(ref(ids[None]).logits[0, :-1].float(), -1).gather(-1, ids[1:, None])[:, 0]
            loss = -(lp * mask[1:]).sum() / n
            loss.backward()
            total += float(loss)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        return total, sum(ids.numel() for ids, _ in batch)

    def meg_step(batch):
        return train_step(meg, meg_opt, None, pack(batch, args.tokens))["loss"], sum(i.numel() for i, _ in batch)

    (meg_tps, meg_losses), (ref_tps, ref_losses) = interleaved(meg_step, ref_step, batches)
    print(f"SFT step: megatron {meg_tps:.0f} tok/s, reference {ref_tps:.0f} tok/s, ratio {meg_tps / ref_tps:.2f}")
    return {"samples_per_step": args.samples, "micro_batch_tokens": args.tokens,
            "megatron_tokens_per_s": round(meg_tps, 1), "reference_tokens_per_s": round(ref_tps, 1),
            "ratio": round(meg_tps / ref_tps, 3),
            "first_loss_megatron": round(meg_losses[0], 5), "first_loss_reference": round(ref_losses[0], 5)}


def bench_packing(args, model_dir) -> dict:
    """Packed vs padded micro-batches of one mixed-length step, the same trainer (see the module docstring)."""
    from rstar_hpc.trainer.packing import pack, pad
    from rstar_hpc.trainer.step import train_step

    gen = torch.Generator().manual_seed(5)
    lengths = [args.short_tokens] * args.mix_short + [args.long_tokens] * args.mix_long
    batches = []
    for _ in range(args.steps + 1):
        order = torch.randperm(len(lengths), generator=gen).tolist()  # long ones anywhere in the step
        step = []
        for n in (lengths[i] for i in order):
            mask = torch.ones(n, dtype=torch.bool)
            mask[0] = False
            step.append((torch.randint(0, 400, (n,), generator=gen), mask))
        batches.append(step)
    rows = max(1, args.pack_tokens // args.long_tokens)
    packed, packed_opt = trainer_policy(model_dir, lr=1e-3)
    padded, padded_opt = trainer_policy(model_dir, lr=1e-3)

    def pack_step(batch):
        return train_step(packed, packed_opt, None, pack(batch, args.pack_tokens))["loss"], sum(lengths)

    def pad_step(batch):
        return train_step(padded, padded_opt, None, pad(batch, rows))["loss"], sum(lengths)

    (pack_tps, pack_losses), (pad_tps, pad_losses) = interleaved(pack_step, pad_step, batches)
    print(f"mixed-length step: packed {pack_tps:.0f} tok/s, padded {pad_tps:.0f} tok/s, ratio {pack_tps / pad_tps:.2f}")
    slots = len(lengths) * max(lengths)
    return {"mix_lengths": f"{args.mix_short}x{args.short_tokens}+{args.mix_long}x{args.long_tokens}",
            "mix_tokens_per_step": sum(lengths), "mix_padded_slots_per_step": slots,
            "pack_micro_batch_tokens": args.pack_tokens, "pad_rows_per_micro_batch": rows,
            "packed_tokens_per_s": round(pack_tps, 1), "padded_tokens_per_s": round(pad_tps, 1),
            "packing_ratio": round(pack_tps / pad_tps, 3),
            "first_loss_packed": round(pack_losses[0], 6), "first_loss_padded": round(pad_losses[0], 6)}


def bench_rl(args, model_dir: str, tmp: str) -> dict:
    """The RL step (see the module docstring); needs the process group of main()."""
    import numpy as np
    from transformers import Qwen3ForCausalLM

    from rstar_hpc.algo.loss import policy_loss
    from rstar_hpc.config import load_config
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.synthetic.trajectories import make_step
    from rstar_hpc.exchange.writer import ShardWriter
    from rstar_hpc.trainer.arch import Arch
    from rstar_hpc.trainer.rl import TrajectorySource, rl_step

    budget = max(args.tokens, 4 * args.rl_response_tokens)
    cfg = load_config("tiny-cpu", [f"run.root={tmp}", f"model.path={model_dir}", f"trainer.micro_batch_tokens={budget}",
                                   "trainer.optimizer.lr=1e-4", "trainer.optimizer.weight_decay=0.0"])
    vocab = Arch.from_hf_config(model_dir).vocab_size
    paths = RunPaths(cfg.run.dir)
    rng = np.random.default_rng(0)
    for step in range(args.steps + 1):
        trajs = make_step("bench", "rl", step, args.rl_prompts, cfg.algo.num_samples_per_prompt,
                          mean_tokens=args.rl_response_tokens, seed=1, text=False)
        for t in trajs:  # the tiny vocabulary; shorter prompts; rewards mixed per group
            t.prompt_ids = np.asarray(t.prompt_ids[:64]) % vocab
            t.response_ids = np.asarray(t.response_ids) % vocab
            t.reward = float(t.sample_index % 2 == 0 or rng.random() < 0.3)
        with ShardWriter(paths, "rl", step, "rollout") as w:
            w.write(trajs)
            w.commit()
    source = TrajectorySource(paths, "rl", cfg.algo, cfg.trainer, run_seed=cfg.run.seed)
    t0 = time.perf_counter()
    batches = [source.next() for _ in range(args.steps + 1)]
    read_s = (time.perf_counter() - t0) / len(batches)

    meg, meg_opt = trainer_policy(model_dir, lr=1e-4)
    ref = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, weight_decay=0.0)

    def ref_logprobs(ids: torch.Tensor) -> torch.Tensor:
        lp = torch.log_softmax(ref(ids[None]).logits[0, :-1].float(), -1).gather(-1, ids[1:, None])[:, 0]
        return torch.cat([lp.new_zeros(1), lp])  # token-aligned, as the trainer's

    def ref_step(batch) -> tuple[float, int]:
        ref.eval()
        with torch.no_grad():  # pi_old recomputed, as trainer.recompute_old_logprobs asks
            old = [ref_logprobs(ids) for ids, _ in batch.samples]
        ref.train()
        ref_opt.zero_grad(set_to_none=True)
        n = sum(int(m.sum()) for _, m in batch.samples)
        pg = 0.0
        for (ids, mask), o, adv in zip(batch.samples, old, batch.advantages):
            loss, stats = policy_loss(ref_logprobs(ids), o, adv, mask, cfg.algo.loss, global_num_tokens=n)
            loss.backward()
            pg += float(stats["pg_loss_sum"]) / n
        torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.trainer.optimizer.grad_clip)
        ref_opt.step()
        return pg, sum(ids.numel() for ids, _ in batch.samples)

    def meg_step(batch) -> tuple[float, int]:
        m = rl_step(meg, meg_opt, None, batch, cfg.algo.loss, cfg.trainer)
        return m["train/pg_loss"], sum(ids.numel() for ids, _ in batch.samples)

    (meg_tps, meg_pg), (ref_tps, ref_pg) = interleaved(meg_step, ref_step, batches)
    kept_tokens = [sum(ids.numel() for ids, _ in b.samples) for b in batches]
    print(f"RL step: megatron {meg_tps:.0f} tok/s, reference {ref_tps:.0f} tok/s, ratio {meg_tps / ref_tps:.2f}; "
          f"read {read_s * 1e3:.1f} ms/step")
    return {"rl_trajectories_per_step": args.rl_prompts * cfg.algo.num_samples_per_prompt,
            "rl_kept_per_step": batches[0].num_kept, "rl_tokens_per_step": round(float(np.mean(kept_tokens)), 1),
            "rl_micro_batch_tokens": budget, "rl_megatron_tokens_per_s": round(meg_tps, 1),
            "rl_reference_tokens_per_s": round(ref_tps, 1), "rl_ratio": round(meg_tps / ref_tps, 3),
            "rl_read_s_per_step": round(read_s, 4),
            "rl_first_pg_loss_megatron": round(meg_pg[0], 6), "rl_first_pg_loss_reference": round(ref_pg[0], 6)}


if __name__ == "__main__":
    main()
