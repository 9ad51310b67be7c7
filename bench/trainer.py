"""Tokens/s of one trainer step: the Megatron policy vs plain PyTorch (Hugging Face Qwen3ForCausalLM), same run.

Both models start from the same tiny checkpoint, take the same packed micro-batches and the same token-mean
masked NLL with AdamW and clipping; the reference runs each sample as its own unpadded sequence (no packing
support in plain HF). The last stdout line is one JSON object of the figures.

    python bench/trainer.py [--steps 5] [--samples 16] [--tokens 1024]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings

import torch

warnings.filterwarnings("ignore")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1024, help="micro-batch token budget")
    args = ap.parse_args()

    from transformers import Qwen3ForCausalLM

    from rstar_hpc.config.schema import TinyModelSpec
    from rstar_hpc.models.tiny import make_tiny_model
    from rstar_hpc.trainer.hf_convert import load_hf_checkpoint
    from rstar_hpc.trainer.model import Qwen3Arch, build_model, destroy_distributed, init_distributed
    from rstar_hpc.trainer.sft import SFTData
    from rstar_hpc.trainer.sft_data import make_samples, write_jsonl
    from rstar_hpc.trainer.step import build_optimizer, pack, train_step
    from transformers import AutoTokenizer

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

    def timed(fn) -> tuple[float, list[float]]:
        fn(batches[0])  # warm-up step, not timed
        tokens, t0, losses = 0, time.perf_counter(), []
        for b in batches[1:]:
            loss, n = fn(b)
            tokens += n
            losses.append(loss)
        return tokens / (time.perf_counter() - t0), losses

    def meg_step(batch):
        m = train_step(meg, meg_opt, None, pack(batch, args.tokens), grad_clip=1.0)
        return m["loss"], sum(ids.numel() for ids, _ in batch)

    meg_tps, meg_losses = timed(meg_step)
    ref_tps, ref_losses = timed(ref_step)
    destroy_distributed()
    figures = {"bench": "trainer_step", "device": "cpu", "threads": torch.get_num_threads(),
               "steps": args.steps, "samples_per_step": args.samples, "micro_batch_tokens": args.tokens,
               "megatron_tokens_per_s": round(meg_tps, 1), "reference_tokens_per_s": round(ref_tps, 1),
               "ratio": round(meg_tps / ref_tps, 3),
               "first_loss_megatron": round(meg_losses[0], 5), "first_loss_reference": round(ref_losses[0], 5)}
    print(f"megatron {meg_tps:.0f} tok/s, reference {ref_tps:.0f} tok/s, ratio {meg_tps / ref_tps:.2f}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
