"""`rstar-hpc doctor` passes on a ready host and names a concrete fix for what fails."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _doctor(env, *args):
    p = subprocess.run([sys.executable, "-m", "rstar_hpc", "doctor", "--json", "--skip", "vllm", *args],
                       capture_output=True, text=True, env=env, timeout=180)
    return p.returncode, {c["name"]: c for c in json.loads(p.stdout)}


@pytest.mark.slurm
def test_ready_host_passes(slurm_cluster, tmp_path):
    code, checks = _doctor(slurm_cluster.env, "--run-root", str(tmp_path / "runs"))
    assert code == 0, checks
    for name in ("bwrap", "slurm", "mpi", "run-dir", "offline"):
        assert checks[name]["status"] in ("ok", "warn"), checks[name]
    assert checks["bwrap"]["status"] == "ok" and checks["slurm"]["status"] == "ok" and checks["mpi"]["status"] == "ok"
    assert "partitions: cpu, gpu" in checks["slurm"]["detail"]
    assert "vllm" not in checks


def test_failures_name_a_fix_and_set_the_exit_code(tmp_path):
    env = {**os.environ, "SLURM_CONF": str(tmp_path / "no-such-slurm.conf")}
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        env.pop(k, None)
    readonly = tmp_path / "ro"
    readonly.mkdir()
    blocker = readonly / "file"
    blocker.write_text("")
    code, checks = _doctor(env, "--run-root", str(blocker / "runs"))     # a path under a regular file
    assert code == 1
    assert checks["slurm"]["status"] == "fail" and "cluster up" in checks["slurm"]["fix"]
    assert checks["run-dir"]["status"] == "fail" and "RSTAR_HPC_RUN_ROOT" in checks["run-dir"]["fix"]
    assert checks["offline"]["status"] == "warn" and "export HF_HUB_OFFLINE=1" in checks["offline"]["fix"]
