"""The SFT step of a realistically sized Qwen3 (usually on a GPU): the trainer's policy vs Hugging Face.

Run through `python bench/trainer.py --model qwen3-1.7b --device cuda ...` (see its docstring). The policy is the
trainer's (`parallel.build_policy`, one rank, bf16 weights with megatron's fp32 main weights and fp32 gradient
buffer: what `trainer.params_dtype: bfloat16` trains); the reference is `Qwen3ForCausalLM` (SDPA attention) with
the same weights, batches, loss, AdamW and clipping, one unpadded sequence per sample. The two run one after the
other, each after its own warm-up steps. MFU = model FLOPs / step time / `--peak-tflops`, model FLOPs as the
trainer's perf/mfu counts them (trainer/flops.py: 3 passes of matmul parameters and causal attention).
"""
from __future__ import annotations

import gc
import os
import statistics
import time

import torch

from rstar_hpc.models.shapes import PUBLISHED
from rstar_hpc.trainer.flops import mfu, model_flops


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


def _hf_config(args):
    from transformers import Qwen3Config

    s = PUBLISHED[args.model]
    return Qwen3Config(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                       num_hidden_layers=args.layers or s.num_layers, num_attention_heads=s.num_heads,
                       num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim, rms_norm_eps=1e-6, rope_theta=1e6,
                       max_position_embeddings=40960, tie_word_embeddings=s.tie_word_embeddings)


def _batches(args, vocab: int) -> list[list]:
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.warmup + args.steps):
        lens = torch.randint(args.seq_len // 8, args.seq_len // 2 + 1, (args.samples,), generator=gen).tolist()
        batch = []
        for n in lens:
            mask = torch.ones(n, dtype=torch.bool)
            mask[0] = False
            batch.append((torch.randint(0, vocab, (n,), generator=gen), mask))
        batches.append(batch)
    return batches


def _timed(args, arch, batches, step) -> dict:
    """Time `step` (batch -> loss) over the batches; the peak GPU memory from here on."""
    cuda = args.device == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i, batch in enumerate(batches):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(float(step(batch)))
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    timed = batches[args.warmup:]
    tokens = [sum(ids.numel() for ids, _ in b) for b in timed]
    flops = [model_flops(arch, [ids.numel() for ids, _ in b])[0] for b in timed]
    return {"tokens_per_s": statistics.median(t / s for t, s in zip(tokens, times)),
            "mfu": statistics.median(mfu(f, s, args.peak_tflops) for f, s in zip(flops, times)),
            "step_s": statistics.median(times), "losses": losses,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def _megatron_phase(args, arch, weights, batches) -> tuple[dict, int]:
    """The trainer's policy; its model and optimizer are gone (off the GPU) once this returns."""
    from rstar_hpc.config.trainer import TrainerConfig
    from rstar_hpc.trainer.hf_convert import hf_to_megatron
    from rstar_hpc.trainer.parallel import build_optimizer, build_policy
    from rstar_hpc.trainer.step import pack, train_step

    tcfg = TrainerConfig(backend=args.device, params_dtype="bfloat16", micro_batch_tokens=args.seq_len,
                         optimizer={"lr": 1e-5, "weight_decay": 0.0, "grad_clip": 1.0})
    policy = build_policy(arch, tcfg, args.device)
    model = policy.single_module()
    names = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    mine, params = hf_to_megatron(weights, arch, 1, 0, names), model.state_dict(keep_vars=True)
    with torch.no_grad():
        for k, v in mine.items():
            params[k].copy_(v)
    del mine, params
    opt = build_optimizer(policy, tcfg, 1e-5)
    fig = _timed(args, arch, batches, lambda b: train_step(policy, opt, None, pack(b, args.seq_len))["loss"])
    return fig, sum(p.numel() for p in policy.parameters())


def _reference_phase(args, config, arch, weights, batches) -> dict:
    """Hugging Face Qwen3 (SDPA attention), one unpadded sequence per sample."""
    from transformers import Qwen3ForCausalLM

    device = torch.device(args.device)
    with torch.device(device):
        ref = Qwen3ForCausalLM(config).to(torch.bfloat16)
    ref.load_state_dict(weights)
    ref.train()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-5, weight_decay=0.0)

    def ref_step(batch) -> torch.Tensor:
        ref_opt.zero_grad(set_to_none=True)
        n = sum(int(m.sum()) for _, m in batch)
        total = torch.zeros((), device=device)
        for ids, mask in batch:
            ids, mask = ids.to(device), mask.to(device)
            lp = torch.log_softmax(ref(ids[None]).logits[0, :-1].float(), -1).gather(-1, ids[1:, None])[:, 0]
            loss = -(lp * mask[1:]).sum() / n
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        return total
    return _timed(args, arch, batches, ref_step)


def bench_sized(args) -> dict:
    """The SFT step of a Qwen3 of published shape: the trainer's policy vs Hugging Face, one after the other."""
    from transformers import Qwen3ForCausalLM

    from rstar_hpc.trainer.arch import Arch
    from rstar_hpc.trainer.model import have_transformer_engine
    from rstar_hpc.trainer.parallel import destroy_distributed, init_distributed

    config = _hf_config(args)
    arch = Arch.from_hf_config(config.to_dict())
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    init_distributed(tp=1, backend=args.device)
    torch.manual_seed(0)  # Hugging Face's init, kept on the host: each phase holds only its own model
    with torch.device(args.device):
        weights = {k: v.to("cpu", torch.bfloat16) for k, v in Qwen3ForCausalLM(config).state_dict().items()}
    batches = _batches(args, arch.vocab_size)
    meg, params_total = _megatron_phase(args, arch, weights, batches)
    print(f"megatron: {meg['tokens_per_s']:.0f} tok/s, MFU {meg['mfu']:.3f}, peak {meg['peak_mem_gib']}")
    ref = _reference_phase(args, config, arch, weights, batches)
    print(f"reference: {ref['tokens_per_s']:.0f} tok/s, MFU {ref['mfu']:.3f}, peak {ref['peak_mem_gib']}")
    destroy_distributed()
    cuda = args.device == "cuda"

    def r(x, k=4):
        return None if x is None else round(x, k)
    out = {"bench": "trainer_sft_step_sized", "device": torch.cuda.get_device_name() if cuda else "cpu",
           "torch": torch.__version__, "model": args.model, "layers": arch.num_layers,
           "params_matmul": model_flops(arch, [1])[1], "params_total": params_total,
           "dtype": "bfloat16 (fp32 main weights)", "layer_spec": "transformer_engine" if cuda and
           have_transformer_engine() else "local+sdpa", "sdpa_flash_with_gqa": flash_sdpa_ok(arch) if cuda else None,
           "micro_batch_tokens": args.seq_len, "samples_per_step": args.samples,
           "tokens_per_step_mean": round(statistics.mean(sum(i.numel() for i, _ in b) for b in batches), 1),
           "warmup_steps": args.warmup, "timed_steps": args.steps, "peak_tflops": args.peak_tflops,
           "flops_formula": "6*N*tokens + 6*layers*heads*head_dim*sum(len^2) (causal attention)"}
    for name, fig in (("megatron", meg), ("reference", ref)):
        out.update({f"{name}_tokens_per_s": round(fig["tokens_per_s"], 1), f"{name}_mfu": r(fig["mfu"]),
                    f"{name}_step_s": r(fig["step_s"]), f"{name}_peak_mem_gib": r(fig["peak_mem_gib"], 2),
                    f"first_loss_{name}": r(fig["losses"][0], 5), f"last_loss_{name}": r(fig["losses"][-1], 5)})
    out["ratio"] = round(meg["tokens_per_s"] / ref["tokens_per_s"], 3)
    return out
