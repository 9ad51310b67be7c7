"""Fixtures of the integration tests: one launched run that the launch tests share."""
from __future__ import annotations

import json
import time

import pytest
from launching import _tail, ci_config, rstar


@pytest.fixture(scope="session")
def sbatch_run(slurm_cluster, tiny_model_dir, tmp_path_factory):
    """The all-stage tiny config launched through sbatch and followed to its end (--wait): (run dir, env, launch
    info, wall seconds). The uninterrupted reference of the chaos test."""
    tmp = tmp_path_factory.mktemp("launch-sbatch")
    config = ci_config(tmp, "all-stages", tiny_model_dir)
    env = {**slurm_cluster.env, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = rstar("launch", str(config), "--wait", "--json", "--timeout-s", "1200", env=env, timeout=1300, check=False)
    run = tmp / "runs" / "all-stages"
    assert proc.returncode == 0, proc.stderr[-3000:] + "\n" + _tail(run)
    return run, env, json.loads(proc.stdout.splitlines()[-1]), time.monotonic() - t0


