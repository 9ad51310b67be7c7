"""Fixtures of the integration tests: rstar-hpc installed from its wheel, and one run launched with that install
that the launch tests share."""
from __future__ import annotations

import json
import time

import pytest
import yaml
from tests.helpers.installing import install
from tests.helpers.launching import _tail, ci_config


@pytest.fixture(scope="session")
def installed(tmp_path_factory):
    """The wheel of this tree installed into a fresh venv (installing.py): what a site or a container image has."""
    return install(tmp_path_factory.mktemp("installed"))


@pytest.fixture(scope="session")
def sbatch_run(hosts_cluster, tiny_model_dir, installed, tmp_path_factory):
    """The all-stage tiny config launched through sbatch with the installed package, from a directory that is no
    checkout, and followed to its end (--wait): (run dir, env, launch info, wall seconds). Its jobs run the installed
    rstar_hpc (test_installed.py checks their logs). On a cluster of hosts, its rollout on two of them (rank 0 and
    an engine on one, an engine on the other: they join across the bridge). The uninterrupted reference of the
    chaos test."""
    tmp = tmp_path_factory.mktemp("launch-sbatch")
    config = ci_config(tmp, "all-stages", tiny_model_dir)
    cfg = yaml.safe_load(config.read_text())
    cfg["launch"]["rollout"]["num_nodes"] = 2
    config.write_text(yaml.safe_dump(cfg))
    env = {**hosts_cluster.env, "OMP_NUM_THREADS": "1"}   # installed.rstar drops PYTHONPATH
    t0 = time.monotonic()
    proc = installed.rstar("launch", str(config), "--wait", "--json", "--timeout-s", "1200", env=env, timeout=1300,
                           check=False)
    run = tmp / "runs" / "all-stages"
    assert proc.returncode == 0, proc.stderr[-3000:] + "\n" + _tail(run)
    return run, env, json.loads(proc.stdout.splitlines()[-1]), time.monotonic() - t0


