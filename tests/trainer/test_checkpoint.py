"""Checkpoints: exact resume, a save killed midway never becomes `latest`, optimizer reset, save-on-signal."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from tests.helpers.trainer import BACKENDS, run_trainer, sft_batch, train_state, write_config

from rstar_hpc.trainer.checkpoint import (
    DIE_IN_SAVE_ENV,
    SaveOnSignal,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from rstar_hpc.synthetic.sft_chats import make_samples, write_jsonl
from rstar_hpc.trainer.step import train_step


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_load_in_process_and_optimizer_reset(dist1, tiny_hf_dir, tmp_path, backend):
    a = train_state(tiny_hf_dir, backend)
    for s in range(3):
        train_step(a.model, a.optimizer, a.scheduler, sft_batch(a.model.arch.vocab_size, s))
    a.step, a.data_state = 3, {"cursor": 42}
    path = save_checkpoint(a, tmp_path / "ckpt")
    assert path.name == "step-00000003" and latest_checkpoint(tmp_path / "ckpt") == path
    expected_next = torch.rand(3)  # the draw right after the save...
    torch.manual_seed(1234)        # ...then the generator moves on

    b = train_state(tiny_hf_dir, backend)
    load_checkpoint(b, tmp_path / "ckpt")
    assert b.step == 3 and b.data_state == {"cursor": 42}
    assert torch.equal(torch.rand(3), expected_next)  # RNG restored to the saved point
    for (n, pa), pb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        if isinstance(pa, torch.Tensor):
            assert torch.equal(pa, pb), n
    assert b.scheduler.last_epoch == a.scheduler.last_epoch
    ma = train_step(a.model, a.optimizer, a.scheduler, sft_batch(a.model.arch.vocab_size, 9))
    mb = train_step(b.model, b.optimizer, b.scheduler, sft_batch(b.model.arch.vocab_size, 9))
    assert ma["loss"] == mb["loss"] and ma["lr"] == mb["lr"]
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)  # AdamW moments were restored, so the update is identical

    c = train_state(tiny_hf_dir, backend)
    load_checkpoint(c, tmp_path / "ckpt" / "step-00000003", reset_optimizer=True)
    assert c.step == 3 and c.scheduler.last_epoch == 0
    assert all(not opt.optimizer.state for opt in c.optimizer.chained_optimizers)  # no AdamW moments loaded


def test_a_checkpoint_saved_before_any_update_loads_with_its_optimizer(dist1, tiny_hf_dir, tmp_path):
    """RL steps that RoC leaves empty never step AdamW, so their checkpoint has no moments; the next stage (or a
    resume) loads it as the same fresh optimizer instead of failing on the missing keys."""
    a = train_state(tiny_hf_dir)
    a.step = 1
    save_checkpoint(a, tmp_path / "ckpt")
    b = train_state(tiny_hf_dir)
    load_checkpoint(b, tmp_path / "ckpt")
    assert b.step == 1
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    m = train_step(b.model, b.optimizer, b.scheduler, sft_batch(b.model.arch.vocab_size, 1))
    assert m["loss"] == m["loss"]   # it trains on


def test_missing_checkpoint_is_named(dist1, tiny_hf_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="COMMITTED.json"):
        load_checkpoint(train_state(tiny_hf_dir), tmp_path / "nothing")


def test_usr2_requests_a_save():
    handler = SaveOnSignal()
    try:
        assert not handler.should_save()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert handler.should_save()
    finally:
        handler.close()


def _losses(metrics: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, metrics.read_text().splitlines())]


@pytest.mark.parametrize("backend", BACKENDS)
def test_kill_mid_save_then_resume_matches_uninterrupted_run(tiny_hf_dir, tmp_path, backend):
    """The trainer role's SFT stage, killed (as by SIGKILL) after writing step 4's shards and before the commit,
    resumes from step 2 and then logs the same losses as a run that was never interrupted."""
    data = write_jsonl(make_samples(40, seed=0, system=""), tmp_path / "train.jsonl")
    cfg = write_config(tmp_path / "cfg.yaml", tiny_hf_dir,
                       [{"name": "sft", "kind": "sft", "num_steps": 6, "prompts_per_step": 4, "lr": 2e-3,
                         "data": str(data)}],
                       micro_batch_tokens=1024, optimizer={"warmup_steps": 2}, backend=backend,
                       checkpoint={"save_every_steps": 2, "keep_last": 3})
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert run_trainer(cfg, "sft", f"run.root={ref}", log=tmp_path / "ref.log") == 0, \
        (tmp_path / "ref.log").read_text()[-3000:]

    rc = run_trainer(cfg, "sft", f"run.root={run}", env={DIE_IN_SAVE_ENV: "4"}, log=tmp_path / "killed.log")
    assert rc == 137, (tmp_path / "killed.log").read_text()[-3000:]
    root = run / "tiny-cpu" / "ckpt" / "sft"
    assert latest_checkpoint(root) == root / "step-00000002"  # the half-written step 4 is not trusted
    assert any(".step-00000004.tmp-" in p.name for p in root.iterdir())

    assert run_trainer(cfg, "sft", f"run.root={run}", log=tmp_path / "resumed.log") == 0
    assert f"resumed from {root}/step-00000002 (step 2)" in (tmp_path / "resumed.log").read_text()
    ref_losses = dict(_losses(ref / "tiny-cpu" / "metrics" / "trainer.jsonl"))
    logged = _losses(run / "tiny-cpu" / "metrics" / "trainer.jsonl")
    assert [s for s, _ in logged] == [1, 2, 3, 3, 4, 5, 6]  # steps 1-3 of the killed run, then the resumed 3-6
    for step, loss in logged[3:]:
        assert loss == ref_losses[step], (step, loss, ref_losses[step])
    assert latest_checkpoint(root) == root / "step-00000006"
