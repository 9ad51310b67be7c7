"""submitit starts the same jobs the sbatch templates do, on the real local cluster, sized from the config."""
from __future__ import annotations

import pytest

from rstar_hpc.config import load_config
from rstar_hpc.launch.submitit_launch import executor, submit_command, wait
from rstar_hpc.models.tiny import is_tiny_model

pytestmark = pytest.mark.slurm


def test_executor_takes_role_resources_from_config(tmp_path):
    cfg = load_config("qwen3-14b", [f"run.root={tmp_path}"])
    ex = executor(cfg, "trainer")
    params = ex._executor.parameters
    assert params["partition"] == "gpu" and params["nodes"] == 4 and params["gpus_per_node"] == 8
    assert params["time"] == 1440 and params["signal_delay_s"] == 300
    assert params["additional_parameters"] == {"requeue": True, "open-mode": "append"}
    with pytest.raises(ValueError, match="unknown role 'critic'; roles: trainer, rollout, sandbox"):
        executor(cfg, "critic")


def test_submitit_job_runs_an_rstar_hpc_command_on_a_cluster_node(slurm_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}"])
    out = tmp_path / "tiny"
    job = submit_command(cfg, "sandbox", ["make-tiny-model", str(out), "--layers", "1", "--seed", "3"])
    stdout = wait(job, timeout_s=180)
    assert f"{out}: qwen3" in stdout
    assert is_tiny_model(out)
    assert (tmp_path / "tiny-cpu" / "logs" / "submitit").is_dir()
