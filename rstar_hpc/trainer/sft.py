"""SFT mode: chat JSONL in the rStar2 tool-call format, loss on assistant tokens only.

Each JSONL line is `{"messages": [{"role": ..., "content": ...}, ...]}` with roles system, user, assistant and
tool. It is rendered exactly as the chat template of `rstar_hpc.models.chat_format` renders it (tool messages
merged into one user turn of `<tool_response>` blocks), and the trained tokens are the assistant contents plus
their `<|im_end|>`, minus the `<reason>` that the generation prompt prefills at inference.
Schedule: linear warm-up then cosine (the paper's SFT recipe); AdamW.

    python -m rstar_hpc.trainer.sft --model DIR --data train.jsonl --ckpt-root DIR --num-steps 400
"""
from __future__ import annotations

import argparse
import json
import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rstar_hpc.models import chat_format as fmt
from rstar_hpc.trainer.step import pack, sequence_logprobs

log = logging.getLogger(__name__)
ROLES = ("system", "user", "assistant", "tool")


def render_segments(messages: list[dict]) -> list[tuple[str, bool]]:
    """The conversation as (text, trained) pieces whose concatenation is the chat-template rendering."""
    segs: list[tuple[str, bool]] = []
    if not messages or messages[0]["role"] != "system":
        segs.append((f"{fmt.IM_START}system\n{fmt.SYSTEM_PREAMBLE}{fmt.IM_END}\n", False))
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role == "tool":
            first = i == 0 or messages[i - 1]["role"] != "tool"
            last = i == len(messages) - 1 or messages[i + 1]["role"] != "tool"
            text = (f"{fmt.IM_START}user" if first else "") + f"\n<tool_response>\n{content}\n</tool_response>"
            segs.append((text + (f"{fmt.IM_END}\n" if last else ""), False))
        elif role == "assistant":
            prefill = "<reason>" if content.startswith("<reason>") else ""
            segs.append((f"{fmt.IM_START}assistant\n{prefill}", False))
            segs.append((content[len(prefill):] + fmt.IM_END, True))
            segs.append(("\n", False))
        else:
            segs.append((f"{fmt.IM_START}{role}\n{content}{fmt.IM_END}\n", False))
    return segs


def tokenize_conversation(messages: list[dict], tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, loss_mask) of one conversation; pieces are tokenized separately so the mask is exact."""
    ids: list[int] = []
    mask: list[bool] = []
    for text, trained in render_segments(messages):
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        mask += [trained] * len(piece)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)


def load_chat_jsonl(path: str | Path) -> list[list[dict]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such SFT data file; generate the demo set with "
                                f"`python -m rstar_hpc.trainer.sft_data {path}`")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            msgs = json.loads(line)["messages"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: expected a JSON object with a 'messages' list ({e})") from e
        for m in msgs:
            if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ValueError(f"{path}:{n}: message {m!r} needs role in {ROLES} and string content")
        if not any(m["role"] == "assistant" for m in msgs):
            raise ValueError(f"{path}:{n}: no assistant message, nothing to train on")
        out.append(msgs)
    if not out:
        raise ValueError(f"{path}: empty SFT data file")
    return out


class SFTData:
    """Tokenized samples served in seeded shuffled epochs; `state_dict()` is the cursor (epoch, position)."""

    def __init__(self, samples: list[tuple[torch.Tensor, torch.Tensor]], seed: int = 0, max_tokens: int | None = None):
        if max_tokens is not None:
            samples = [(i[:max_tokens], m[:max_tokens]) for i, m in samples]
        self.samples, self.seed = samples, seed
        self.epoch, self.pos = 0, 0
        self._order = self._shuffle()

    @classmethod
    def from_jsonl(cls, path: str | Path, tokenizer, **kwargs) -> SFTData:
        return cls([tokenize_conversation(m, tokenizer) for m in load_chat_jsonl(path)], **kwargs)

    def _shuffle(self) -> list[int]:
        order = list(range(len(self.samples)))
        random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def next_samples(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for _ in range(n):
            if self.pos == len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._shuffle()
            out.append(self.samples[self._order[self.pos]])
            self.pos += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed, "num_samples": len(self.samples)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_samples") != len(self.samples):
            raise ValueError(f"checkpoint cursor is for {state.get('num_samples')} samples, the data has "
                             f"{len(self.samples)}; resume with the same data file or reset the cursor")
        self.seed, self.epoch, self.pos = state["seed"], state["epoch"], state["pos"]
        self._order = self._shuffle()


@torch.no_grad()
def evaluate(model: torch.nn.Module, samples: list[tuple[torch.Tensor, torch.Tensor]],
             token_budget: int) -> float:
    """Token-mean NLL of the trained tokens of `samples` (no gradients, no state change)."""
    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for mb in pack(samples, token_budget):
        mb = mb.to(device)
        lp = sequence_logprobs(model, mb)
        total += float(-(lp * mb.loss_mask).sum())
        count += int(mb.loss_mask.sum())
    model.train()
    return total / max(count, 1)


# --------------------------------------------------------------------------------------------------
# the loop


def run_sft(*, model_dir: str | Path, data: str | Path, num_steps: int, samples_per_step: int = 32,
            lr: float = 2e-3, warmup_steps: int = 20, min_lr_ratio: float = 0.1, weight_decay: float = 0.0,
            grad_clip: float = 1.0, micro_batch_tokens: int = 8192, tp: int = 1, seed: int = 0,
            ckpt_root: str | Path | None = None, save_every_steps: int = 0, keep_last: int = 3,
            resume: bool = True, reset_optimizer: bool = False, eval_data: str | Path | None = None,
            eval_samples: int = 64, on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
    """Supervised fine-tuning from a Hugging Face checkpoint; returns the per-step metrics.

    With `ckpt_root`, resumes from its latest complete checkpoint (unless `resume=False`), saves every
    `save_every_steps` and when SIGUSR2 arrives, and always at the end.
    """
    from transformers import AutoTokenizer

    from rstar_hpc.trainer.checkpoint import (
        SaveOnSignal,
        TrainState,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )
    from rstar_hpc.trainer.hf_convert import load_hf_checkpoint
    from rstar_hpc.trainer.model import Qwen3Arch, build_model, init_distributed
    from rstar_hpc.trainer.step import build_optimizer, build_scheduler, train_step

    # -- setup
    init_distributed(tp=tp, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train = SFTData.from_jsonl(data, tokenizer, seed=seed, max_tokens=micro_batch_tokens)
    held_out = SFTData.from_jsonl(eval_data, tokenizer).samples[:eval_samples] if eval_data else None
    model = build_model(Qwen3Arch.from_hf_config(model_dir), seed=seed)
    load_hf_checkpoint(model, model_dir)
    optimizer = build_optimizer(model, lr=lr, weight_decay=weight_decay)
    scheduler = build_scheduler(optimizer, warmup_steps, num_steps, "cosine", min_lr_ratio)
    state = TrainState(model, optimizer, scheduler)
    if ckpt_root is not None and resume and latest_checkpoint(ckpt_root) is not None:
        load_checkpoint(state, ckpt_root, reset_optimizer=reset_optimizer)
        train.load_state_dict(state.data_state)
        log.info("resumed from step %d", state.step)
    signal_save = SaveOnSignal()

    # -- loop
    history: list[dict] = []
    eval_before = evaluate(model, held_out, micro_batch_tokens) if held_out is not None else None
    try:
        while state.step < num_steps:
            batch = pack(train.next_samples(samples_per_step), micro_batch_tokens)
            metrics = train_step(model, optimizer, scheduler, batch, grad_clip=grad_clip)
            state.step += 1
            state.data_state = train.state_dict()
            if held_out is not None and (state.step % 10 == 0 or state.step == num_steps):
                metrics["eval_loss"] = evaluate(model, held_out, micro_batch_tokens)
            if eval_before is not None and not history:
                metrics["eval_loss_before"] = eval_before
            history.append({"step": state.step, **metrics})
            if on_step is not None:
                on_step(state.step, metrics)
            if ckpt_root is not None and (signal_save.should_save() or state.step == num_steps or
                                          (save_every_steps and state.step % save_every_steps == 0)):
                save_checkpoint(state, ckpt_root, keep_last=keep_last)
                signal_save.clear()
    finally:
        signal_save.close()
    return history


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="SFT of a Qwen3 policy on rStar2-format chat JSONL")
    ap.add_argument("--model", required=True, help="Hugging Face model directory")
    ap.add_argument("--data", required=True)
    ap.add_argument("--eval-data")
    ap.add_argument("--ckpt-root")
    ap.add_argument("--num-steps", type=int, required=True)
    ap.add_argument("--samples-per-step", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup-steps", type=int, default=20)
    ap.add_argument("--save-every-steps", type=int, default=0)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-resume", action="store_true")
    ap.add_argument("--reset-optimizer", action="store_true")
    ap.add_argument("--metrics-out", help="append one JSON line per step here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[trainer %(levelname)s] %(message)s")

    def on_step(step: int, m: dict) -> None:
        log.info("step %d loss %.4f grad_norm %.3f lr %.2e tok/s %.0f%s", step, m["loss"], m["grad_norm"], m["lr"],
                 m["tokens_per_s"], f" eval_loss {m['eval_loss']:.4f}" if "eval_loss" in m else "")
        if args.metrics_out and torch.distributed.get_rank() == 0:
            with open(args.metrics_out, "a") as f:
                f.write(json.dumps({"step": step, **m}) + "\n")

    from rstar_hpc.trainer.model import destroy_distributed

    try:
        run_sft(model_dir=args.model, data=args.data, eval_data=args.eval_data, ckpt_root=args.ckpt_root,
                num_steps=args.num_steps, samples_per_step=args.samples_per_step, lr=args.lr,
                warmup_steps=args.warmup_steps, save_every_steps=args.save_every_steps,
                micro_batch_tokens=args.micro_batch_tokens, tp=args.tp, seed=args.seed,
                resume=not args.no_resume, reset_optimizer=args.reset_optimizer, on_step=on_step)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()


class SFTStageData:
    """An SFT stage for the trainer role (`rstar_hpc.trainer.main`): `stages[].data` served `prompts_per_step`
    samples per step, split over data-parallel ranks; the cursor lives in the checkpoint."""

    def __init__(self, cfg, stage, model_dir: str | Path):
        from megatron.core import parallel_state
        from transformers import AutoTokenizer

        if stage.data is None:
            raise ValueError(f"stage {stage.name!r} (sft) has no `data`; set stages[].data to a chat JSONL file "
                             f"(the demo set: `python -m rstar_hpc.trainer.sft_data PATH`)")
        self.cfg, self.stage = cfg, stage
        self.dp, self.dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        if stage.prompts_per_step < self.dp:
            raise ValueError(f"stage {stage.name!r}: prompts_per_step={stage.prompts_per_step} samples per step cannot "
                             f"be split over {self.dp} data-parallel ranks; raise it to at least {self.dp}")
        self.data = SFTData.from_jsonl(stage.data, AutoTokenizer.from_pretrained(model_dir), seed=cfg.run.seed,
                                       max_tokens=cfg.trainer.micro_batch_tokens)
        self.initial_state = self.data.state_dict()

    def next(self, stop_requested=None):
        # samples are always ready, so there is no wait to interrupt; every rank draws the step's samples (same
        # cursor everywhere) and trains its slice
        return pack(self.data.next_samples(self.stage.prompts_per_step)[self.dp_rank::self.dp],
                    self.cfg.trainer.micro_batch_tokens)

    def train(self, model, optimizer, scheduler, micro_batches) -> dict[str, float]:
        from rstar_hpc.trainer.step import train_step

        return train_step(model, optimizer, scheduler, micro_batches, grad_clip=self.cfg.trainer.optimizer.grad_clip)

    def state_dict(self) -> dict[str, Any]:
        return self.data.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.load_state_dict(state)

    def commit(self, checkpoint: str) -> None:
        pass
