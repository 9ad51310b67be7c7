"""The trainer role end to end in one process per stage: SFT, then an RL stage that carries the SFT policy and
AdamW moments over (with its own lr and schedule), consumes trajectory steps, skips the update of an all-dropped
step, publishes a version per step and acks the cursor after its checkpoint; then a stage with an optimizer reset that gets
USR2 while it waits for trajectories, saves and exits for a requeue."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from tests.helpers.trainer import free_port, rl_step_trajs, rl_traj

from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.writer import ShardWriter
from rstar_hpc.synthetic.sft_chats import make_samples, write_jsonl

REPO = Path(__file__).resolve().parents[2]
SFT_LR, RL_LR, RL_WARMUP = 2e-3, 1e-4, 2


def _train(cfg: Path, stage: str, tmp_path: Path) -> str:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "jobs" / "trainer.py"), str(cfg), "--stage", stage], env=env,
                          capture_output=True, text=True, timeout=240, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


def test_sft_then_rl_stage(tiny_hf_dir, tmp_path):
    data = write_jsonl(make_samples(16, seed=0, system=""), tmp_path / "train.jsonl")
    tree = yaml.safe_load((REPO / "configs" / "tiny-cpu.yaml").read_text())
    tree["run"]["root"] = str(tmp_path / "runs")
    tree["model"] = {"path": str(tiny_hf_dir)}
    tree["trainer"].update(micro_batch_tokens=512, publish_keep_last=2,
                           optimizer={"lr": RL_LR, "warmup_steps": RL_WARMUP, "schedule": "constant"},
                           checkpoint={"save_every_steps": 2, "keep_last": 2})
    tree["stages"] = [{"name": "sft", "kind": "sft", "num_steps": 2, "prompts_per_step": 2, "lr": SFT_LR,
                       "data": str(data)},
                      {"name": "rl", "kind": "rl", "num_steps": 3, "prompts_per_step": 2},
                      {"name": "rl2", "kind": "rl", "num_steps": 3, "prompts_per_step": 2, "reset_optimizer": True}]
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tree))
    paths = RunPaths(tmp_path / "runs" / "tiny-cpu")

    _train(cfg, "sft", tmp_path)
    assert paths.policies().complete_steps() == [1]

    gen = torch.Generator().manual_seed(0)
    steps = {0: rl_step_trajs(0), 1: [rl_traj(1, "all-right", i, 1.0, gen) for i in range(8)], 2: rl_step_trajs(2)}
    for s, trajs in steps.items():
        with ShardWriter(paths, "rl", s, "rollout") as w:
            w.write(trajs)
            w.commit()
    log = _train(cfg, "rl", tmp_path)
    assert "weights and AdamW moments from" in log and "ckpt/sft/step-00000002 (stage sft)" in log
    assert "RoC kept no trajectory" in log

    rl = [r for r in _rows(paths) if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2, 3]
    assert rl[0]["lr"] == pytest.approx(RL_LR / RL_WARMUP)  # this stage's lr and warm-up, not SFT's decayed lr
    # a version per step, the empty one included: the rollout's next step waits for its trainer_step
    assert [r["policy_version"] for r in rl] == [2, 3, 4]
    markers = [paths.policies().marker(v) for v in (3, 4)]
    assert [(m["stage"], m["trainer_step"]) for m in markers] == [("rl", 2), ("rl", 3)]
    assert rl[1]["train/skipped_empty_step"] == 1.0 and rl[1]["roc/groups_rejected_equal"] == 1
    for r in rl:
        assert r["time/read(s)"] >= 0 and r["time/step(s)"] > 0
    assert "time/checkpoint(s)" in rl[1] and "time/publish(s)" in rl[2] and rl[0]["tokens_per_s"] > 0
    assert paths.policies().complete_steps() == [3, 4]  # publish_keep_last=2
    cursor = json.loads(paths.cursor("rl", "trainer").read_text())
    assert cursor["next_step"] == 3 and cursor["state"] == {"checkpoint": "step-00000003"}
    state = json.loads(paths.stage_state("rl").read_text())
    assert state["status"] == "DONE" and state["step"] == 3 and state["policy_version"] == 4


    # rl2 has one trajectory step so far; USR2 (the pre-timeout signal) while the trainer waits for the next
    with ShardWriter(paths, "rl2", 0, "rollout") as w:
        trajs = [rl_traj(0, f"q{g}", i, float(i % 2), gen) for g in range(2) for i in range(8)]
        for t in trajs:
            t.stage = "rl2"
        w.write(trajs)
        w.commit()
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    err = tmp_path / "rl2.err"
    with open(err, "w") as f:
        proc = subprocess.Popen([sys.executable, str(REPO / "jobs" / "trainer.py"), str(cfg), "--stage", "rl2"],
                                env=env, stderr=f, stdout=subprocess.DEVNULL, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(r["stage"] == "rl2" for r in _rows(paths)):
            assert proc.poll() is None, err.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(1.0)  # now waiting for trajectory step 1
        proc.send_signal(signal.SIGUSR2)
        assert proc.wait(timeout=120) == 0, err.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    log = err.read_text()
    assert "weights from" in log and "ckpt/rl/step-00000003 (stage rl); optimizer reset" in log
    assert "USR2: saved at step 1" in log
    assert paths.checkpoints("rl2").latest()[0] == 1
    assert json.loads(paths.cursor("rl2", "trainer").read_text())["next_step"] == 1
    state = json.loads(paths.stage_state("rl2").read_text())
    assert state["status"] == "RUNNING" and "USR2" in state["message"] and state["step"] == 1


def _rows(paths: RunPaths) -> list[dict]:
    return [json.loads(x) for x in paths.metrics("trainer").read_text().splitlines()]
