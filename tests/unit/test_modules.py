"""The environment-module files put an installed prefix (a venv holding the wheel, not a checkout) on PATH and set
what rstar-hpc reads (Tcl evaluated for real with tclsh; Lua checked against the same variable list)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

MODULES = Path(__file__).resolve().parents[2] / "modules" / "rstar-hpc"
EXPECTED = {"RSTAR_HPC_CONFIGS", "RSTAR_HPC_RUN_ROOT", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"}

# Minimal stand-ins for the module commands, so tclsh evaluates the real modulefile and prints its effect.
TCL_HARNESS = r"""
proc module-whatis {args} {}
proc setenv {k v} { global env; set env($k) $v; puts "setenv $k=$v" }
proc prepend-path {k v} { puts "prepend $k=$v" }
source [lindex $argv 0]
"""


@pytest.mark.skipif(shutil.which("tclsh") is None, reason="tclsh not installed (apt-get install tcl)")
def test_tcl_module_sets_path_run_root_and_offline_flags(tmp_path):
    harness = tmp_path / "harness.tcl"
    harness.write_text(TCL_HARNESS)
    env = {"PATH": "/usr/bin:/bin", "HOME": "/home/u", "RSTAR_HPC_PREFIX": "/opt/site/rstar-hpc", "SCRATCH": "/lustre/u"}
    out = subprocess.run(["tclsh", str(harness), str(MODULES / "0.1.0")], capture_output=True, text=True, env=env,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    got = dict(re.findall(r"setenv (\w+)=(\S+)", out.stdout))
    assert set(got) == EXPECTED
    assert got["RSTAR_HPC_RUN_ROOT"] == "/lustre/u/rstar-hpc/runs"
    assert got["HF_HUB_OFFLINE"] == "1"
    assert "prepend PATH=/opt/site/rstar-hpc/bin" in out.stdout and ".venv" not in out.stdout
    assert got["RSTAR_HPC_CONFIGS"] == "/opt/site/rstar-hpc/etc/rstar-hpc/configs"


def test_lua_module_sets_the_same_variables():
    text = (MODULES / "0.1.0.lua").read_text()
    assert set(re.findall(r'^setenv\("(\w+)"', text, re.M)) == EXPECTED
    assert 'prepend_path("PATH", pathJoin(prefix, "bin"))' in text and ".venv" not in text
