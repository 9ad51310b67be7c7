"""scripts/gpu-check.sh --dry: the GPU check's steps (the trainer's SFT and RL steps, with and without recompute,
the plan beside them) run on the CPU at a tiny shape and end with one JSON line of the figures."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_dry_runs_every_step_and_prints_its_figures():
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), "--dry"], capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["check"] == "gpu" and out["device"] == "cpu (--dry)"
    out = out["models"]["dry"]
    assert out["params"] > 0
    top = out["none"]["profile"]["top"]   # the profiler's top ops (kernels on a GPU), with their share of the time
    assert len(top) == 10 and all(t[1] >= 0 for t in top) and 0 < sum(t[2] for t in top) <= 1.0001
    assert "profile" not in out["selective"]
    for recompute in ("none", "selective"):
        fig = out[recompute]
        for kind in ("sft", "rl"):
            assert fig[kind]["tokens_per_s"] > 0 and fig[kind]["tokens_per_step"] > 0
        assert fig["planned_gib"]["total"] >= fig["planned_gib"]["overhead"] > 0
    # selective recompute plans fewer activation bytes than none for the same shape
    assert out["selective"]["planned_gib"]["activations"] <= out["none"]["planned_gib"]["activations"]


def test_gpu_check_without_the_wheels_says_how_to_bring_them(tmp_path):
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), "--dry"], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env={"PATH": "/usr/bin:/bin", "PYTHON": "/usr/bin/python3",
                                                     "RSTAR_WHEELS": str(tmp_path)})
    assert done.returncode == 2 and "--fetch-wheels" in done.stderr
