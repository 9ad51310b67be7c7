"""rstar-hpc installed from its wheel, as a site admin or a container image installs it (installing.py): the wheel
carries the configs, the sbatch templates and the planner's engine model; the verbs run from a directory that is no
checkout; a run launched with it on the local Slurm cluster (the shared sbatch_run) runs the installed package in
every job."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="the wheel is built from git's file list")


def test_the_wheel_carries_what_a_run_needs(installed):
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    assert {"rstar_hpc/_shipped/configs/tiny-cpu.yaml", "rstar_hpc/_shipped/configs/qwen3-14b.yaml",
            "rstar_hpc/_shipped/configs/demo.yaml", "rstar_hpc/_shipped/sbatch/run.sbatch",
            "rstar_hpc/_shipped/sbatch/trainer.sbatch", "rstar_hpc/planner/engine_sim.py",
            "sandbox/worker/server.py"} <= names
    assert not any(n.startswith(("bench/", "tests/", "configs/", "sbatch/")) for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "rstar-hpc = rstar_hpc.cli:main" in zipfile.ZipFile(installed.wheel).read(entry).decode()


@pytest.fixture
def short_home():
    """A home whose ~/.rstar-hpc/cluster keeps the emulated cluster's socket paths within 107 bytes (pytest's
    tmp_path, deeper under pytest-xdist, does not)."""
    home = Path(tempfile.mkdtemp(prefix="rstar-home-", dir="/tmp"))
    yield home
    shutil.rmtree(home, ignore_errors=True)


def test_the_verbs_run_from_the_install_outside_any_checkout(installed, tmp_path, short_home):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(short_home), "RSTAR_HPC_RUN_ROOT": str(tmp_path / "runs")}
    imported = subprocess.run([str(installed.python), "-c", "import rstar_hpc, sandbox; print(rstar_hpc.__file__);"
                               "print(sandbox.__file__)"], capture_output=True, text=True, cwd=installed.cwd, env=env,
                              check=True).stdout.split()
    assert all(p.startswith(str(installed.site_packages)) for p in imported), imported
    listed = installed.rstar("config", "show", "--list", env=env).stdout
    assert re.search(r"^tiny-cpu\s+packaged\s+" + re.escape(str(installed.site_packages)), listed, re.M), listed
    assert installed.rstar("config", "validate", "tiny-cpu", env=env).stdout.startswith("ok: tiny-cpu")
    plan = json.loads(installed.rstar("plan", "qwen3-14b", "--json", env=env).stdout.splitlines()[-1])
    assert plan["overlap"]["gpu_hours_total"] > 0 and plan["parameters"] > 1e10, plan   # engine_sim ran
    assert "rl-8k" in installed.rstar("train", "qwen3-14b", "--plan", env=env).stdout
    script = installed.rstar("launch", "tiny-cpu", "--dry-run", env=env).stdout
    assert f"exec {installed.python} -m rstar_hpc.launch.supervise" in script
    assert f"{installed.python} -m rstar_hpc rollout --config" in script
    # a site folder ($RSTAR_HPC_CONFIGS) wins over the packaged configs, ./configs over both
    site = tmp_path / "site"
    site.mkdir()
    mine = yaml.safe_load(installed.rstar("config", "show", "tiny-cpu", env=env).stdout)
    (site / "tiny-cpu.yaml").write_text(yaml.safe_dump({**mine, "run": {**mine["run"], "name": "from-site"}}))
    env["RSTAR_HPC_CONFIGS"] = str(site)
    assert yaml.safe_load(installed.rstar("config", "show", "tiny-cpu", env=env).stdout)["run"]["name"] == "from-site"
    assert re.search(r"^tiny-cpu\s+\$RSTAR_HPC_CONFIGS\s+", installed.rstar("config", "show", "--list",
                                                                            env=env).stdout, re.M)
    (installed.cwd / "configs").mkdir(exist_ok=True)
    (installed.cwd / "configs" / "tiny-cpu.yaml").write_text(yaml.safe_dump({**mine, "run": {"name": "from-cwd"}}))
    try:
        assert yaml.safe_load(installed.rstar("config", "show", "tiny-cpu", env=env).stdout)["run"]["name"] == \
            "from-cwd"
    finally:
        shutil.rmtree(installed.cwd / "configs")
    bad = installed.rstar("config", "show", "tiny-gpu", env=env, check=False)
    assert bad.returncode != 0 and "known configs: demo, demo-noisy, qwen3-14b, tiny-cpu" in bad.stderr, bad.stderr


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.vllm
def test_every_job_of_a_launched_run_ran_the_installed_package(sbatch_run, installed):
    """The shared sbatch run was launched with the installed console script: the supervisor and every role's
    processes say, in their first log line, that they run the installed rstar_hpc."""
    run = sbatch_run[0]
    text = "\n".join(p.read_text(errors="replace") for p in (run / "logs").rglob("*") if p.is_file())
    origins = re.findall(r" (\w+)\[[^\]]*\] INFO rstar_hpc: rstar-hpc [\d.]+ from (\S+),", text)
    roles = {role for role, _ in origins}
    assert {"supervisor", "trainer", "rollout", "sandbox"} <= roles, sorted(roles)
    assert {where for _, where in origins} == {str(installed.site_packages / "rstar_hpc")}, set(origins)
