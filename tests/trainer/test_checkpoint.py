"""Checkpoints: exact resume, a save killed midway never becomes `latest`, optimizer reset, save-on-signal."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import free_port

from rstar_hpc.trainer.checkpoint import (
    DIE_IN_SAVE_ENV,
    SaveOnSignal,
    TrainState,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from rstar_hpc.trainer.hf_convert import load_hf_checkpoint
from rstar_hpc.trainer.model import Qwen3Arch, build_model
from rstar_hpc.trainer.sft_data import make_samples, write_jsonl
from rstar_hpc.trainer.step import build_optimizer, build_scheduler, pack, train_step


def _batch(vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in (12, 20, 9):
        mask = torch.ones(n, dtype=torch.bool)
        mask[0] = False
        samples.append((torch.randint(0, vocab, (n,), generator=g), mask))
    return pack(samples, 64)


def _state(hf_dir) -> TrainState:
    model = build_model(Qwen3Arch.from_hf_config(hf_dir))
    load_hf_checkpoint(model, hf_dir)
    opt = build_optimizer(model, lr=1e-2)
    return TrainState(model, opt, build_scheduler(opt, 2, 10, "cosine"))


def test_save_load_in_process_and_optimizer_reset(dist1, tiny_hf_dir, tmp_path):
    a = _state(tiny_hf_dir)
    for s in range(3):
        train_step(a.model, a.optimizer, a.scheduler, _batch(a.model.arch.vocab_size, s))
    a.step, a.data_state = 3, {"cursor": 42}
    path = save_checkpoint(a, tmp_path / "ckpt")
    assert path.name == "step-00000003" and latest_checkpoint(tmp_path / "ckpt") == path
    expected_next = torch.rand(3)  # the draw right after the save...
    torch.manual_seed(1234)        # ...then the generator moves on

    b = _state(tiny_hf_dir)
    load_checkpoint(b, tmp_path / "ckpt")
    assert b.step == 3 and b.data_state == {"cursor": 42}
    assert torch.equal(torch.rand(3), expected_next)  # RNG restored to the saved point
    for (n, pa), pb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        if isinstance(pa, torch.Tensor):
            assert torch.equal(pa, pb), n
    assert b.scheduler.last_epoch == a.scheduler.last_epoch
    ma = train_step(a.model, a.optimizer, a.scheduler, _batch(a.model.arch.vocab_size, 9))
    mb = train_step(b.model, b.optimizer, b.scheduler, _batch(b.model.arch.vocab_size, 9))
    assert ma["loss"] == mb["loss"] and ma["lr"] == mb["lr"]
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)  # AdamW moments were restored, so the update is identical

    c = _state(tiny_hf_dir)
    load_checkpoint(c, tmp_path / "ckpt" / "step-00000003", reset_optimizer=True)
    assert c.step == 3 and not c.optimizer.state and c.scheduler.last_epoch == 0


def test_missing_checkpoint_is_named(dist1, tiny_hf_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="COMMITTED.json"):
        load_checkpoint(_state(tiny_hf_dir), tmp_path / "nothing")


def test_usr2_requests_a_save():
    handler = SaveOnSignal()
    try:
        assert not handler.should_save()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert handler.should_save()
    finally:
        handler.close()


def _sft(hf_dir, data, root, metrics, extra_env=None) -> tuple[int, str]:
    """Run the SFT entry point in its own session (so a hard exit's orphans can be reaped); (returncode, log)."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path.cwd()), **(extra_env or {})}
    cmd = [sys.executable, "-m", "rstar_hpc.trainer.sft", "--model", str(hf_dir), "--data", str(data),
           "--ckpt-root", str(root), "--num-steps", "6", "--samples-per-step", "4", "--warmup-steps", "2",
           "--save-every-steps", "2", "--micro-batch-tokens", "1024", "--metrics-out", str(metrics)]
    log = Path(str(metrics) + ".log")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=240)
        finally:
            # megatron's checkpoint writer keeps a multiprocessing manager; after a hard exit it is orphaned
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return rc, log.read_text()


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def test_kill_mid_save_then_resume_matches_uninterrupted_run(tiny_hf_dir, tmp_path):
    data = write_jsonl(make_samples(40, seed=0, system=""), tmp_path / "train.jsonl")
    rc, log = _sft(tiny_hf_dir, data, tmp_path / "ref", tmp_path / "ref.jsonl")
    assert rc == 0, log[-3000:]

    rc, log = _sft(tiny_hf_dir, data, tmp_path / "run", tmp_path / "run.jsonl", {DIE_IN_SAVE_ENV: "4"})
    assert rc == 137, log[-3000:]
    root = tmp_path / "run"
    assert latest_checkpoint(root) == root / "step-00000002"  # the half-written step 4 is not trusted
    assert any(".step-00000004.tmp-" in p.name for p in root.iterdir())

    rc, log = _sft(tiny_hf_dir, data, root, tmp_path / "run.jsonl")
    assert rc == 0, log[-3000:]
    assert "resumed from step 2" in log
    ref_losses, run_lines = _losses(tmp_path / "ref.jsonl"), (tmp_path / "run.jsonl").read_text().splitlines()
    after_resume = [json.loads(x) for x in run_lines][4:]  # steps 1-4 of the killed run, then the resumed 3-6
    assert [r["step"] for r in after_resume] == [3, 4, 5, 6]
    for r in after_resume:
        assert r["loss"] == ref_losses[r["step"]], (r["step"], r["loss"], ref_losses[r["step"]])
    assert latest_checkpoint(root) == root / "step-00000006"
