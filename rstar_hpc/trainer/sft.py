"""SFT mode: chat JSONL in the rStar2 tool-call format, loss on assistant tokens only.

Each JSONL line is `{"messages": [{"role": ..., "content": ...}, ...]}` with roles system, user, assistant and
tool. It is rendered exactly as the chat template of `rstar_hpc.models.chat_format` renders it (tool messages
merged into one user turn of `<tool_response>` blocks), and the trained tokens are the assistant contents plus
their `<|im_end|>`, minus the `<reason>` that the generation prompt prefills at inference.
Schedule: linear warm-up then cosine (the paper's SFT recipe, `trainer.optimizer.sft_schedule`); AdamW.
A stage of `kind: sft` with `data: train.jsonl` runs in the trainer role (`rstar_hpc.trainer.job`):

    rstar-hpc train CONFIG --stage sft
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from rstar_hpc.config.stages import StageConfig
from rstar_hpc.data.sets import load_chat_jsonl, load_sft_conversations
from rstar_hpc.models import chat_format as fmt
from rstar_hpc.trainer.packing import MicroBatch
from rstar_hpc.trainer.step import pack


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


class Tokenized(Sequence):
    """Conversations as (input_ids, loss_mask) samples, each tokenized when first read: a stage draws a few
    hundred samples of a file of tens of thousands, and tokenizing them all up front held every launched run's
    trainer for ~50 s before its first step."""

    def __init__(self, conversations: list[list[dict]], tokenizer):
        self.conversations, self.tokenizer = conversations, tokenizer
        self._done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.conversations)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i not in self._done:
            self._done[i] = tokenize_conversation(self.conversations[i], self.tokenizer)
        return self._done[i]


class SFTData:
    """Samples served in seeded shuffled epochs, each cut to `max_tokens`; `state_dict()` is the cursor (epoch,
    position)."""

    def __init__(self, samples: Sequence[tuple[torch.Tensor, torch.Tensor]], seed: int = 0,
                 max_tokens: int | None = None):
        self.samples, self.seed, self.max_tokens = samples, seed, max_tokens
        self.epoch, self.pos = 0, 0
        self._order = self._shuffle()

    @classmethod
    def from_conversations(cls, conversations: list[list[dict]], tokenizer, **kwargs) -> SFTData:
        return cls(Tokenized(conversations, tokenizer), **kwargs)

    @classmethod
    def from_jsonl(cls, path: str | Path, tokenizer, **kwargs) -> SFTData:
        return cls.from_conversations(load_chat_jsonl(path), tokenizer, **kwargs)

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
            ids, mask = self.samples[self._order[self.pos]]
            out.append((ids[:self.max_tokens], mask[:self.max_tokens]) if self.max_tokens else (ids, mask))
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


class SFTStageData:
    """An SFT stage for the trainer role (`rstar_hpc.trainer.job`), a `stage_data.StageData`: `stages[].data`
    served `prompts_per_step` samples per step, split over data-parallel ranks; the cursor lives in the checkpoint,
    so nothing is settled outside it (`commit`) and no policy version matters (`now_holds`)."""

    def __init__(self, cfg, stage_cfg: StageConfig, model_dir: str | Path):
        from megatron.core import parallel_state
        from transformers import AutoTokenizer

        self.cfg, self.stage = cfg, stage_cfg
        self.dp, self.dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        if stage_cfg.prompts_per_step < self.dp:
            raise ValueError(f"stage {stage_cfg.name!r}: prompts_per_step={stage_cfg.prompts_per_step} samples per step cannot "
                             f"be split over {self.dp} data-parallel ranks; raise it to at least {self.dp}")
        chats = load_sft_conversations(stage_cfg, cfg.run.seed, cfg.rollout.agent.system_prompt)
        self.data = SFTData.from_conversations(chats, AutoTokenizer.from_pretrained(model_dir), seed=cfg.run.seed,
                                               max_tokens=cfg.trainer.micro_batch_tokens)
        self.initial_state = self.data.state_dict()

    def next(self, stop_requested: Callable[[], bool] = lambda: False) -> list[MicroBatch]:
        # samples are always ready, so there is no wait to interrupt; every rank draws the step's samples (same
        # cursor everywhere) and trains its slice
        return pack(self.data.next_samples(self.stage.prompts_per_step)[self.dp_rank::self.dp],
                    self.cfg.trainer.micro_batch_tokens)

    def train(self, model, optimizer, scheduler, batch: list[MicroBatch]) -> dict[str, float]:
        from rstar_hpc.trainer.step import train_step

        return train_step(model, optimizer, scheduler, batch)

    def now_holds(self, version: int | None) -> None:
        """A no-op: the samples were written, not generated by a policy, so no token's loss depends on the version
        of the weights (RL's off-policy correction does)."""

    def state_dict(self) -> dict[str, Any]:
        return self.data.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.load_state_dict(state)

    def commit(self, checkpoint: str | None, state: dict | None = None) -> None:
        """A no-op: the cursor lives in the checkpoint alone."""

    def describe(self, metrics: dict[str, float]) -> str:
        return ""
