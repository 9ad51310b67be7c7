"""Every sbatch template parses as bash, says how to use it, and asks Slurm for a partition and a time limit."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

SBATCH = Path(__file__).resolve().parents[2] / "sbatch"
TEMPLATES = sorted(p for p in SBATCH.glob("*.sbatch") if p.name != "run.sbatch")   # run.sbatch: rendered


def test_there_are_templates():
    assert {"generate", "run", "trainer", "rollout", "sandbox"} <= {p.stem for p in SBATCH.glob("*.sbatch")}


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_template_is_valid_bash_with_usage_partition_and_time(path):
    text = path.read_text()
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert text.startswith("#!/bin/bash")
    header = "\n".join(line for line in text.splitlines()[:15] if line.startswith("#"))
    assert re.search(rf"sbatch .*sbatch/{re.escape(path.name)}", header), f"{path.name}: the header should show how to submit it"
    directives = re.findall(r"^#SBATCH (.+)$", text, re.M)
    assert any("--partition" in d for d in directives) and any("--time" in d for d in directives)


@pytest.mark.parametrize("name", ["trainer", "rollout", "sandbox"])
def test_role_templates_save_and_requeue_before_the_time_limit(name):
    text = (SBATCH / f"{name}.sbatch").read_text()
    assert re.search(r"^#SBATCH --signal=B:USR2@\d+$", text, re.M) and "--requeue" in text
    assert "trap " in text and "scontrol requeue" in text


def test_the_run_script_renders_a_valid_hetjob_from_the_config(tmp_path):
    from rstar_hpc.config import load_config
    from rstar_hpc.launch.hetjob import render

    cfg = load_config("qwen3-14b", [f"run.root={tmp_path}", "launch.qos=high", "launch.setup=[source /env/bin/activate]"])
    text = render(cfg, tmp_path / "run")
    path = tmp_path / "run.sbatch"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    components = text.split("#SBATCH hetjob")
    assert len(components) == 3
    for part in components:
        assert "#SBATCH --partition=" in part and "#SBATCH --time=" in part and "#SBATCH --nodes=" in part
    assert "#SBATCH --qos=high" in components[0] and "#SBATCH --qos" not in components[1]
    assert "source /env/bin/activate" in text and "{{" not in text and "#RSTAR-HEADER" not in text
