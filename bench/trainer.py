"""Tokens/s of trainer steps: the Megatron policy vs plain PyTorch (Hugging Face Qwen3ForCausalLM), same run.

SFT step: both models start from the same tiny checkpoint, take the same packed micro-batches and the same
token-mean masked NLL with AdamW and clipping.
RL step: synthetic trajectory steps (paper-shaped: prompt, model turns, masked tool turns) are committed with
the exchange's ShardWriter; the trainer's path reads them (RoC, group advantages, packing) and runs `rl_step`:
pi_old recomputed with the trainer, the GRPO-RoC loss (`rstar_hpc.algo.policy_loss`) normalised by the step's
trained tokens, AdamW, clipping. The reference runs the same kept samples through the same recompute, the same
loss function and the same optimizer. Reading the shards is timed separately (`rl_read_s_per_step`).
The reference runs each sample as its own unpadded sequence (no packing support in plain HF).
The last stdout line is one JSON object of the figures.

    python bench/trainer.py [--steps 5] [--samples 16] [--tokens 1024] [--rl-prompts 4] [--rl-response-tokens 300]

Realistic sizes (`--model qwen3-0.6b|qwen3-1.7b|qwen3-4b`, usually `--device cuda`): the SFT step only, on a
Qwen3-architecture model of that published shape built from its config (random init, bf16 weights, gradients and
AdamW state, no fp32 master copy: what `trainer.params_dtype: bfloat16` trains), synthetic samples of random
tokens (lengths uniform in [seq_len/8, seq_len/2]) packed into micro-batches of `--seq-len` tokens. The two models
run one after the other (the GPU is not shared, so no interleaving), each after its own warm-up steps, with the
same weights and batches; the peak GPU memory of each phase is its weights, gradients, optimizer state and
activations. MFU = model FLOPs / step time / `--peak-tflops` (989: H100 SXM dense bf16), with model FLOPs =
6 * N * tokens + 6 * layers * heads * head_dim * sum(sample_len^2), N the parameters of the matmuls (the
embedding counted once, as the LM head) and the second term causal attention (QK^T and AV, forward + backward).

    python bench/trainer.py --device cuda --model qwen3-1.7b --seq-len 8192 --samples 16 --steps 4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=7, help="timed steps (plus one warm-up)")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1024, help="micro-batch token budget")
    ap.add_argument("--rl-prompts", type=int, default=4, help="prompts per RL step (8 rollouts each, RoC keeps 4)")
    ap.add_argument("--rl-response-tokens", type=int, default=300, help="mean response length of a rollout")
    ap.add_argument("--model", default="tiny", choices=["tiny", *QWEN3_SHAPES],
                    help="tiny: the SFT + RL comparison on the CPU; else the SFT step at that Qwen3 shape")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="for the sized models")
    ap.add_argument("--seq-len", type=int, default=8192, help="sized models: tokens per packed micro-batch")
    ap.add_argument("--layers", type=int, default=None, help="sized models: fewer layers (smoke tests)")
    ap.add_argument("--warmup", type=int, default=2, help="sized models: untimed steps first (compilation)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="MFU denominator (H100 SXM dense bf16)")
    args = ap.parse_args()
    if args.model != "tiny":
        print(json.dumps(bench_sized(args)))
        return
    if args.device != "cpu":
        ap.error("--model tiny runs on the CPU; pick a sized --model for --device cuda")

    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from rstar_hpc.config.run import TinyModelSpec
    from rstar_hpc.models.tiny import make_tiny_model
    from rstar_hpc.trainer.hf_convert import load_hf_checkpoint
    from rstar_hpc.trainer.model import Qwen3Arch, build_model, destroy_distributed, init_distributed
    from rstar_hpc.trainer.sft import SFTData
    from rstar_hpc.trainer.sft_data import make_samples, write_jsonl
    from rstar_hpc.trainer.step import build_optimizer, pack, train_step

    tmp = tempfile.mkdtemp(prefix="bench-trainer-")
    model_dir = make_tiny_model(os.path.join(tmp, "tiny"), TinyModelSpec())
    data = write_jsonl(make_samples(args.samples * (args.steps + 1), seed=0, system=""), os.path.join(tmp, "d.jsonl"))
    samples = SFTData.from_jsonl(data, AutoTokenizer.from_pretrained(model_dir)).samples
    batches = [samples[i * args.samples:(i + 1) * args.samples] for i in range(args.steps + 1)]

    os.environ.setdefault("MASTER_PORT", "29587")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    init_distributed(tp=1)
    meg = build_model(Qwen3Arch.from_hf_config(model_dir))
    load_hf_checkpoint(meg, model_dir)
    meg_opt = build_optimizer(meg, lr=1e-3, weight_decay=0.0)

    ref = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref.train()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)

    def ref_step(batch) -> tuple[float, int]:
        ref_opt.zero_grad(set_to_none=True)
        n = sum(int(m.sum()) for _, m in batch)
        total = 0.0
        for ids, mask in batch:
            logits = ref(ids[None]).logits[0, :-1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[1:, None])[:, 0]
            loss = -(lp * mask[1:]).sum() / n
            loss.backward()
            total += float(loss)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        return total, sum(ids.numel() for ids, _ in batch)

    def meg_step(batch):
        m = train_step(meg, meg_opt, None, pack(batch, args.tokens), grad_clip=1.0)
        return m["loss"], sum(ids.numel() for ids, _ in batch)

    (meg_tps, meg_losses), (ref_tps, ref_losses) = interleaved(meg_step, ref_step, batches)
    figures = {"bench": "trainer_step", "device": "cpu", "threads": torch.get_num_threads(),
               "steps": args.steps, "samples_per_step": args.samples, "micro_batch_tokens": args.tokens,
               "megatron_tokens_per_s": round(meg_tps, 1), "reference_tokens_per_s": round(ref_tps, 1),
               "ratio": round(meg_tps / ref_tps, 3),
               "first_loss_megatron": round(meg_losses[0], 5), "first_loss_reference": round(ref_losses[0], 5)}
    print(f"SFT step: megatron {meg_tps:.0f} tok/s, reference {ref_tps:.0f} tok/s, ratio {meg_tps / ref_tps:.2f}")
    figures.update(bench_rl(args, model_dir, tmp))
    destroy_distributed()
    print(json.dumps(figures))


def bench_rl(args, model_dir: str, tmp: str) -> dict:
    """The RL step (see the module docstring); needs the process group of main()."""
    import numpy as np
    from transformers import Qwen3ForCausalLM

    from rstar_hpc.algo.loss import policy_loss
    from rstar_hpc.config import load_config
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.exchange.synthetic import make_step
    from rstar_hpc.exchange.writer import ShardWriter
    from rstar_hpc.trainer.hf_convert import load_hf_checkpoint
    from rstar_hpc.trainer.model import Qwen3Arch, build_model
    from rstar_hpc.trainer.rl import TrajectorySource, rl_step
    from rstar_hpc.trainer.step import build_optimizer

    budget = max(args.tokens, 4 * args.rl_response_tokens)
    cfg = load_config("tiny-cpu", [f"run.root={tmp}", f"model.path={model_dir}", f"trainer.micro_batch_tokens={budget}",
                                   "trainer.optimizer.lr=1e-4", "trainer.optimizer.weight_decay=0.0"])
    vocab = Qwen3Arch.from_hf_config(model_dir).vocab_size
    paths = RunPaths(cfg.run.dir)
    rng = np.random.default_rng(0)
    for step in range(args.steps + 1):
        trajs = make_step("bench", "rl", step, args.rl_prompts, cfg.algo.num_samples_per_prompt,
                          mean_tokens=args.rl_response_tokens, seed=1, text=False)
        for t in trajs:  # the tiny vocabulary; shorter prompts; RoC left to the trainer; rewards mixed per group
            t.prompt_ids = np.asarray(t.prompt_ids[:64]) % vocab
            t.response_ids = np.asarray(t.response_ids) % vocab
            t.roc_kept = t.roc_reason = None
            t.reward = float(t.sample_index % 2 == 0 or rng.random() < 0.3)
        with ShardWriter(paths, "rl", step, "rollout") as w:
            w.write(trajs)
            w.commit()
    source = TrajectorySource(paths, "rl", cfg)
    t0 = time.perf_counter()
    batches = [source.next() for _ in range(args.steps + 1)]
    read_s = (time.perf_counter() - t0) / len(batches)

    meg = build_model(Qwen3Arch.from_hf_config(model_dir))
    load_hf_checkpoint(meg, model_dir)
    meg_opt = build_optimizer(meg, lr=1e-4, weight_decay=0.0)
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
            pg += stats["pg_loss_sum"] / n
        torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.trainer.optimizer.grad_clip)
        ref_opt.step()
        return pg, sum(ids.numel() for ids, _ in batch.samples)

    def meg_step(batch) -> tuple[float, int]:
        m = rl_step(meg, meg_opt, None, batch, cfg)
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


# published Qwen3 shapes (config.json); vocabulary 151936, RoPE theta 1e6, tied embeddings
QWEN3_SHAPES = {
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128},
    "qwen3-1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128},
    "qwen3-4b": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128},
}


def step_flops(arch, seqlens: list[int]) -> tuple[float, int]:
    """(model FLOPs of one training step over samples of these lengths, N): see the module docstring."""
    h, d = arch.hidden_size, arch.head_dim
    per_layer = h * d * (arch.num_heads + 2 * arch.num_kv_heads) + arch.num_heads * d * h + 3 * h * arch.intermediate_size
    n = arch.num_layers * per_layer + arch.vocab_size * h
    attention = 6 * arch.num_layers * arch.num_heads * d * sum(s * s for s in seqlens)
    return 6.0 * n * sum(seqlens) + attention, n


def flash_sdpa_ok(arch) -> bool:
    """Does SDPA run these attention shapes (bf16, causal, grouped-query) on the flash kernel, as the local spec
    needs for speed on CUDA? (Else SDPA falls back to another kernel.)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, arch.num_heads, 256, arch.head_dim, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, arch.num_kv_heads, 256, arch.head_dim, device="cuda", dtype=torch.bfloat16)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        return True
    except RuntimeError:
        return False


def bench_sized(args) -> dict:
    """The SFT step of a realistically sized Qwen3: the trainer's policy vs Hugging Face, one after the other."""
    import gc

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rstar_hpc.trainer.hf_convert import hf_to_megatron
    from rstar_hpc.trainer.model import (
        Qwen3Arch,
        build_model,
        destroy_distributed,
        have_transformer_engine,
        init_distributed,
    )
    from rstar_hpc.trainer.step import build_optimizer, pack, train_step

    device, dtype, cuda = torch.device(args.device), torch.bfloat16, args.device == "cuda"
    shape = {**QWEN3_SHAPES[args.model], **({"num_hidden_layers": args.layers} if args.layers else {})}
    config = Qwen3Config(vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                         tie_word_embeddings=True, **shape)
    arch = Qwen3Arch.from_hf_config(config.to_dict())
    os.environ.setdefault("MASTER_PORT", "29587")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    init_distributed(tp=1, backend=args.device)

    torch.manual_seed(0)  # Hugging Face's init, kept on the host: each phase holds only its own model
    with torch.device(device):
        weights = {k: v.to("cpu", dtype) for k, v in Qwen3ForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.warmup + args.steps):
        lens = torch.randint(args.seq_len // 8, args.seq_len // 2 + 1, (args.samples,), generator=gen).tolist()
        batch = []
        for n in lens:
            mask = torch.ones(n, dtype=torch.bool)
            mask[0] = False
            batch.append((torch.randint(0, arch.vocab_size, (n,), generator=gen), mask))
        batches.append(batch)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def run(step) -> dict:
        """Time `step` (batch -> loss tensor or float) over the batches; the peak memory from here on."""
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        for i, batch in enumerate(batches):
            sync()
            t0 = time.perf_counter()
            losses.append(float(step(batch)))
            sync()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        tokens = [sum(ids.numel() for ids, _ in b) for b in batches[args.warmup:]]
        flops = [step_flops(arch, [ids.numel() for ids, _ in b])[0] for b in batches[args.warmup:]]
        return {"tokens_per_s": statistics.median(t / s for t, s in zip(tokens, times)),
                "mfu": statistics.median(f / s / (args.peak_tflops * 1e12) for f, s in zip(flops, times)),
                "step_s": statistics.median(times), "losses": losses,
                "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}

    def megatron_phase() -> tuple[dict, int]:
        """The trainer's policy; its model and optimizer are gone (off the GPU) once this returns."""
        meg = build_model(arch, backend=args.device, params_dtype=dtype)
        names = {k for k in meg.state_dict() if not k.endswith("_extra_state")}
        mine, params = hf_to_megatron(weights, arch, 1, 0, names), meg.state_dict(keep_vars=True)
        missing = sorted(n for n in names if n not in mine and not n.endswith("inv_freq"))
        assert not missing, missing
        with torch.no_grad():
            for k, v in mine.items():
                params[k].copy_(v)
        del mine, params
        opt = build_optimizer(meg, lr=1e-5, weight_decay=0.0)
        fig = run(lambda b: train_step(meg, opt, None, pack(b, args.seq_len), grad_clip=1.0)["loss"])
        return fig, sum(p.numel() for p in meg.parameters())

    meg_fig, params_total = megatron_phase()
    print(f"megatron: {meg_fig['tokens_per_s']:.0f} tok/s, MFU {meg_fig['mfu']:.3f}, peak {meg_fig['peak_mem_gib']}")

    # -- the reference: Hugging Face Qwen3 (SDPA attention), one unpadded sequence per sample
    with torch.device(device):
        ref = Qwen3ForCausalLM(config).to(dtype)
    ref.load_state_dict(weights)
    ref.train()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-5, weight_decay=0.0)

    def ref_step(batch) -> torch.Tensor:
        ref_opt.zero_grad(set_to_none=True)
        n = sum(int(m.sum()) for _, m in batch)
        total = torch.zeros((), device=device)
        for ids, mask in batch:
            ids, mask = ids.to(device), mask.to(device)
            logits = ref(ids[None]).logits[0, :-1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[1:, None])[:, 0]
            loss = -(lp * mask[1:]).sum() / n
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        return total

    ref_fig = run(ref_step)
    print(f"reference: {ref_fig['tokens_per_s']:.0f} tok/s, MFU {ref_fig['mfu']:.3f}, peak {ref_fig['peak_mem_gib']}")
    destroy_distributed()
    tokens = [sum(ids.numel() for ids, _ in b) for b in batches]

    def r(x, k=4):
        return None if x is None else round(x, k)
    return {"bench": "trainer_sft_step_sized", "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "model": args.model, "layers": arch.num_layers,
            "params_matmul": step_flops(arch, [1])[1], "params_total": params_total, "dtype": "bfloat16",
            "layer_spec": "transformer_engine" if cuda and have_transformer_engine() else "local+sdpa",
            "sdpa_flash_with_gqa": flash_sdpa_ok(arch) if cuda else None,
            "micro_batch_tokens": args.seq_len, "samples_per_step": args.samples,
            "tokens_per_step_mean": round(statistics.mean(tokens), 1), "warmup_steps": args.warmup,
            "timed_steps": args.steps, "peak_tflops": args.peak_tflops,
            "flops_formula": "6*N*tokens + 6*layers*heads*head_dim*sum(len^2) (causal attention)",
            "megatron_tokens_per_s": round(meg_fig["tokens_per_s"], 1),
            "reference_tokens_per_s": round(ref_fig["tokens_per_s"], 1),
            "ratio": round(meg_fig["tokens_per_s"] / ref_fig["tokens_per_s"], 3),
            "megatron_mfu": r(meg_fig["mfu"]), "reference_mfu": r(ref_fig["mfu"]),
            "megatron_step_s": r(meg_fig["step_s"]), "reference_step_s": r(ref_fig["step_s"]),
            "megatron_peak_mem_gib": r(meg_fig["peak_mem_gib"], 2), "reference_peak_mem_gib": r(ref_fig["peak_mem_gib"], 2),
            "first_loss_megatron": r(meg_fig["losses"][0], 5), "first_loss_reference": r(ref_fig["losses"][0], 5),
            "last_loss_megatron": r(meg_fig["losses"][-1], 5), "last_loss_reference": r(ref_fig["losses"][-1], 5)}


if __name__ == "__main__":
    main()
