"""The `[gpu]` extra resolves to exactly the pinned GPU stack: pip's own resolver, reading the registries' metadata
(`pip install --dry-run`, nothing is installed). Marked `network`: CI reaches the registries; compute nodes never
need to."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _pins() -> dict[str, str]:
    text = (REPO / "setup.py").read_text()
    pins = {}
    for name, spec in re.findall(r'^(TORCH|GPU_VLLM|GPU_TE) = "([^"]+)"', text, re.M):
        pkg, version = re.match(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?==(.+)", spec).groups()
        pins[pkg.lower().replace("_", "-")] = version
    return pins


@pytest.mark.network
@pytest.mark.slow
def test_gpu_extra_resolves_to_the_pinned_versions(tmp_path):
    pins = _pins()
    assert set(pins) == {"torch", "vllm", "transformer-engine"}, pins
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--report", str(report), f"{REPO}[gpu]"], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    for pkg, version in pins.items():
        # torch may resolve to a local build of the same release (2.13.0+cpu where the index serves the CPU wheel)
        assert got.get(pkg, "").split("+")[0] == version, (pkg, got.get(pkg), version)
    assert got["transformer-engine-torch"] == pins["transformer-engine"]
    assert got["megatron-core"] == "0.16.1"
