"""The lr warm-up across stages (pipeline.warmup_steps): once per phase, as the paper warms up; again only where the
optimizer is reset or a stage asks for it. Checked on the shipped 14B recipe and through the real lr schedule."""
from __future__ import annotations

import pytest
import torch

from rstar_hpc import pipeline
from rstar_hpc.config import load_config
from rstar_hpc.trainer.step import build_scheduler


def _warmups(*overrides: str) -> dict[str, int]:
    cfg = load_config("qwen3-14b", list(overrides))
    return {s.name: pipeline.warmup_steps(cfg, s.name) for s in cfg.stages if s.kind in pipeline.TRAINER_KINDS}


def test_consecutive_rl_stages_warm_up_once():
    # sft: the run's first trainer stage; rl-8k: RL's own lr starts; rl-12k carries on rl-8k's optimizer;
    # rl-hard resets the optimizer (the paper's stage 3)
    assert _warmups() == {"sft": 20, "rl-8k": 20, "rl-12k": 0, "rl-hard": 20}


def test_without_the_reset_the_hard_stage_carries_on_and_a_stage_can_ask():
    assert _warmups("stages.rl-hard.reset_optimizer=false")["rl-hard"] == 0
    assert _warmups("stages.rl-12k.warmup_steps=5")["rl-12k"] == 5
    assert _warmups("stages.rl-hard.warmup_steps=0")["rl-hard"] == 0


@pytest.mark.parametrize("stage, first_lr_fraction", [("rl-8k", 1 / 20), ("rl-12k", 1.0), ("rl-hard", 1 / 20)])
def test_the_first_step_of_each_stage_trains_at_its_scheduled_lr(stage, first_lr_fraction):
    cfg = load_config("qwen3-14b")
    st, lr = cfg.stage(stage), cfg.trainer.optimizer.lr
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = build_scheduler(opt, pipeline.warmup_steps(cfg, stage), st.num_steps, cfg.trainer.optimizer.schedule)
    lrs = []
    for _ in range(25):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(lr * first_lr_fraction)
    assert lrs[24] == pytest.approx(lr)            # at the stage's lr once any warm-up is over
    assert sum(x < lr * (1 - 1e-9) for x in lrs) == (19 if first_lr_fraction < 1 else 0)
