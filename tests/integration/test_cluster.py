"""The emulated Slurm cluster is real: heterogeneous jobs span its nodes, and `down` leaves nothing behind."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rstar_hpc.cluster import LocalCluster

pytestmark = pytest.mark.slurm


def test_nodes_carry_role_partitions_and_features(slurm_cluster):
    nodes = slurm_cluster.status()["nodes"]
    assert {n: (d["partition"], d["features"]) for n, d in nodes.items()} == {
        "gpu1": ("gpu", "gpu"), "gpu2": ("gpu", "gpu"), "cpu1": ("cpu", "cpu"), "cpu2": ("cpu", "cpu")}
    assert all(d["state"] == "idle" for d in nodes.values())


def test_idempotent_up_and_status_reports_health(slurm_cluster):
    pids = dict(slurm_cluster._recorded())
    slurm_cluster.up()                                           # already up: a no-op
    assert slurm_cluster._recorded() == pids
    assert slurm_cluster.is_up()


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                found.append(f"{proc.name}: {cmd}")
    return found


def test_down_stops_only_its_own_daemons_and_leaves_none_behind():
    a_dir = Path(tempfile.mkdtemp(prefix="rstar-a-", dir="/tmp"))
    b_dir = Path(tempfile.mkdtemp(prefix="rstar-b-", dir="/tmp"))
    a, b = LocalCluster(a_dir), LocalCluster(b_dir)
    try:
        a.up()
        b.up()
        a_pids = list(a._recorded().values())
        assert len(a_pids) == 6 and _processes_mentioning(str(a_dir))
        stopped = a.down()
        assert len(stopped) == 6
        assert _processes_mentioning(str(a_dir)) == []
        assert not any(Path(f"/proc/{p}").exists() and a._alive("x", p) for p in a_pids)
        assert b.is_up(), "stopping one cluster must not touch another"
        assert a.down() == []                                    # a second down is a no-op
    finally:
        a.down()
        b.down()
        shutil.rmtree(a_dir, ignore_errors=True)
        shutil.rmtree(b_dir, ignore_errors=True)
    assert _processes_mentioning(str(b_dir)) == []


def test_cli_up_status_down_round_trip():
    state = Path(tempfile.mkdtemp(prefix="rstar-c-", dir="/tmp"))
    cli = [sys.executable, "-m", "rstar_hpc"]
    env = {**os.environ}
    try:
        up = subprocess.run([*cli, "cluster", "up", "--state-dir", str(state), "--gpu-nodes", "1", "--cpu-nodes", "1"],
                            capture_output=True, text=True, env=env, timeout=120)
        assert up.returncode == 0, up.stderr
        assert f"SLURM_CONF={state}/slurm.conf" in up.stdout
        st = subprocess.run([*cli, "cluster", "status", "--state-dir", str(state)], capture_output=True, text=True,
                            timeout=60)
        assert st.returncode == 0 and "gpu1" in st.stdout and "cpu1" in st.stdout and "idle" in st.stdout
        down = subprocess.run([*cli, "cluster", "down", "--state-dir", str(state)], capture_output=True, text=True,
                              timeout=60)
        assert down.returncode == 0 and "slurmctld" in down.stdout
        st = subprocess.run([*cli, "cluster", "status", "--state-dir", str(state)], capture_output=True, text=True,
                            timeout=60)
        assert st.returncode == 1 and "DOWN" in st.stdout
        assert _processes_mentioning(str(state)) == []
    finally:
        LocalCluster(state).down()
        shutil.rmtree(state, ignore_errors=True)
