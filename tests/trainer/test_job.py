"""The trainer as a real Slurm job: `rstar-hpc train --submit` sends an SFT stage through sbatch/trainer.sbatch and
follows it; Slurm's pre-timeout USR2 (sent to the batch shell, as `--signal=B:USR2@...` does) makes every rank
save and exit, the script requeues the job, and the requeued run resumes from that checkpoint to the end."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rstar_hpc.synthetic.sft_chats import make_samples, write_jsonl

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
NUM_STEPS = 16


def _config(tmp_path: Path, model_dir: Path) -> Path:
    data = write_jsonl(make_samples(64, seed=0, system=""), tmp_path / "train.jsonl")
    tree = yaml.safe_load((REPO / "configs" / "tiny-cpu.yaml").read_text())
    tree["run"]["root"] = str(tmp_path / "runs")
    tree["model"] = {"path": str(model_dir)}
    tree["trainer"].update(micro_batch_tokens=512, checkpoint={"save_every_steps": 100, "keep_last": 2})
    tree["stages"] = [{"name": "sft", "kind": "sft", "num_steps": NUM_STEPS, "prompts_per_step": 2, "lr": 2e-3,
                       "data": str(data)}]
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _rows(metrics: Path) -> list[dict]:
    return [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []


def test_train_submits_an_sft_stage_that_saves_on_usr2_requeues_and_resumes(slurm_cluster, tiny_hf_dir, tmp_path):
    cfg = _config(tmp_path, tiny_hf_dir)
    run = tmp_path / "runs" / "tiny-cpu"
    env = {**os.environ, **slurm_cluster.env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # `rstar-hpc train CFG --stage sft --submit`, sized from launch.trainer: two ranks (data parallel) in one srun
    # step, as on a node with two GPUs
    cli_out = tmp_path / "cli.out"
    with open(cli_out, "w") as out:
        cli = subprocess.Popen([sys.executable, "-c", "from rstar_hpc.cli.train import command; command()", str(cfg),
                                "launch.trainer.tasks_per_node=2", "launch.trainer.cpus_per_task=2",
                                "launch.trainer.time_min=10", "--stage", "sft", "--submit"],
                               env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    log = None
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not _rows(run / "metrics" / "trainer.jsonl"):
            assert cli.poll() is None, cli_out.read_text()
            time.sleep(0.2)
        assert _rows(run / "metrics" / "trainer.jsonl"), f"no step logged in 240 s: {cli_out.read_text()}"
        job = re.search(r"submitted job (\d+)", cli_out.read_text()).group(1)
        log = run / "logs" / f"trainer-sft-{job}.out"
        # what Slurm does `signal_lead_s` before the time limit: USR2 to the batch shell only
        subprocess.run(["scancel", "--batch", "--signal=USR2", job], env=env, check=True)
        assert cli.wait(timeout=400) == 0, cli_out.read_text()
    finally:
        if cli.poll() is None:
            cli.kill()
        print(log.read_text()[-4000:] if log is not None and log.exists() else "no job log")
    assert f"job {job} completed; stage sft at step {NUM_STEPS}/{NUM_STEPS}" in cli_out.read_text()
    text = log.read_text()
    assert "saved on USR2; requeueing" in text
    steps = [r["step"] for r in _rows(run / "metrics" / "trainer.jsonl")]
    assert steps == list(range(1, NUM_STEPS + 1)), steps  # every step trained once: none lost, none repeated
    k = int(re.search(r"USR2: saved at step (\d+)", text).group(1))
    assert 1 <= k < NUM_STEPS
    assert f"resumed from {run}/ckpt/sft/step-{k:08d} (step {k})" in text  # the requeued run
    state = json.loads((run / "stages" / "sft" / "state.json").read_text())
    assert state["status"] == "DONE" and state["step"] == NUM_STEPS and state["slurm_job_id"] == job
    assert (run / "ckpt" / "sft" / "latest").read_text().strip() == f"step-{NUM_STEPS:08d}"
    assert (run / "policy" / "latest").read_text().strip() == "v-00000001"  # SFT publishes its final policy
    assert text.count("[trainer 1]") == 0 and text.count("sft step 16/16") == 1  # rank 0 alone reports
