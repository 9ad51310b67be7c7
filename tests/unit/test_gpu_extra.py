"""The `[gpu]` extra resolves to exactly the pinned GPU stack from binary wheels alone, for Linux x86_64 and this
Python: pip's own resolver, reading the registries' metadata (`pip install --dry-run --only-binary=:all:`, nothing
is installed or built). So a site installs it without a compiler; Transformer Engine, whose PyTorch extension is
published as source only, is an extra of its own (`te`) and is left to the trainer image's base. Marked `network`: CI
reaches the registries; compute nodes never need to."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# glibc 2.35 and older (Ubuntu 22.04, RHEL 9); the stack's newest floor is llguidance's manylinux_2_31
PLATFORMS = ([f"manylinux_2_{minor}_x86_64" for minor in range(5, 36)]
             + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"])


def _pins() -> dict[str, str]:
    text = (REPO / "setup.py").read_text()
    pins = {}
    for name, spec in re.findall(r'^(TORCH|GPU_VLLM|GPU_TE) = "([^"]+)"', text, re.M):
        pkg, version = re.match(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?==(.+)", spec).groups()
        pins[pkg.lower().replace("_", "-")] = version
    return pins


@pytest.mark.network
@pytest.mark.slow
def test_gpu_extra_resolves_from_binary_wheels_to_the_pinned_versions(tmp_path):
    pins = _pins()
    assert set(pins) == {"torch", "vllm", "transformer-engine"}, pins
    report = tmp_path / "report.json"
    platform = [arg for p in PLATFORMS for arg in ("--platform", p)]
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--only-binary=:all:", *platform, "--implementation", "cp",
                           "--python-version", f"{sys.version_info.major}.{sys.version_info.minor}",
                           "--report", str(report), f"{REPO}[gpu]"], capture_output=True, text=True, timeout=1200)
    errors = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("WARNING"))
    assert proc.returncode == 0, errors[-3000:]
    got = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    # torch may resolve to a local build of the same release (2.13.0+cpu where the index serves the CPU wheel)
    assert got["torch"].split("+")[0] == pins["torch"] and got["vllm"] == pins["vllm"], got
    assert got["megatron-core"] == "0.16.1"
    assert not any(name.startswith("transformer-engine") for name in got), "the gpu extra must not compile TE"
