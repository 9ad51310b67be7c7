"""Every sbatch template parses as bash, says how to use it, and asks Slurm for a partition and a time limit."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

SBATCH = Path(__file__).resolve().parents[2] / "sbatch"
TEMPLATES = sorted(SBATCH.glob("*.sbatch"))


def test_there_are_templates():
    assert {"generate", "hello-hetjob"} <= {p.stem for p in TEMPLATES}


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
