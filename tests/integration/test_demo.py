"""`make demo`'s command, `rstar-hpc demo`, end to end on the local Slurm cluster with configs/demo.yaml shortened
for CI (fewer steps and problems; the real figures are in the README): an SFT run, RL runs from its policy (RoC and
the paper's GRPO baseline, which samples and trains G per prompt), and the report, with the last stdout line one JSON object of the figures."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHORT = ["stages.sft.num_steps=30", "stages.eval-base.max_prompts=16", "stages.eval-sft.max_prompts=16",
         "stages.eval.max_prompts=16", "stages.rl-short.num_steps=1", "stages.rl.num_steps=1",
         "stages.rl-hard.num_steps=1", "stages.hard.max_prompts=16", "eval.k=2"]

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(shutil.which("ompi-server") is None or shutil.which("bwrap") is None,
                                 reason="needs Open MPI (ompi-server) and bwrap")]


@pytest.mark.timeout(1800)
def test_demo_trains_through_launch_and_reports(slurm_cluster, tmp_path):
    # scratch goes under TMPDIR (the jobs inherit it) and is gone when the demo ends: vLLM's sockets and caches,
    # torch's kernel cache. A short path: vLLM's IPC socket paths must fit 107 bytes
    scratch = Path(tempfile.mkdtemp(prefix="demo-tmp-", dir="/tmp"))
    env = {**slurm_cluster.env, "OMP_NUM_THREADS": "1", "RSTAR_HPC_CLUSTER_DIR": str(slurm_cluster.dir),
           "TMPDIR": str(scratch)}
    proc = subprocess.run([sys.executable, "-m", "rstar_hpc", "demo", "demo", f"run.root={tmp_path}", *SHORT,
                           "--modes", "RoC,GRPO", "--timeout-s", "900"], capture_output=True, text=True, env=env,
                          timeout=1800, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("pass1_base", "pass1_sft", "pass1_rl", "pass1_rl_stderr", "roc_positive_tool_error_ratio",
                "grpo_positive_tool_error_ratio", "wall_s", "report"):
        assert key in out, key
    assert all(0.0 <= out[k] <= 1.0 for k in ("pass1_base", "pass1_sft", "pass1_rl"))
    # the fair ablation: GRPO samples G = 4 and trains them; RoC samples 2G = 8 and keeps G (configs/demo.yaml).
    # This short SFT rarely solves a problem, so a step may train no group at all (None); any group trained holds G
    assert out["sampled_per_group"] == {"roc": 8, "grpo": 4}
    assert set(out["trained_per_group"]) == {"roc", "grpo"}
    assert all(v in (None, 4) for v in out["trained_per_group"].values()), out["trained_per_group"]
    # per mode, what the sampled trajectories did over the first and last quarter of RL steps (the trainer's
    # behaviour/* records); a ratio is None only where no sampled trajectory made a call
    assert set(out["modes"]) == {"roc", "grpo"}
    for key, mode in out["modes"].items():
        assert {"pass1", "pass1_stderr", "sampled_tool_error_ratio_first", "sampled_tool_error_ratio_last",
                "response_length_first", "response_length_last"} <= set(mode), mode
        assert mode["response_length_first"] > 0 and 0 <= mode["pass1"] <= 1, (key, mode)
        assert all(mode[k] is None or 0 <= mode[k] <= 1 for k in ("sampled_tool_error_ratio_first",
                                                                   "sampled_tool_error_ratio_last")), (key, mode)
    report = Path(out["report"])
    assert report.is_file() and "GRPO" in report.read_text() and list(report.parent.glob("*.png"))
    assert "tool-error ratio of sampled trajectories" in report.read_text()
    for label, run in out["runs"].items():
        st = json.loads(subprocess.run([sys.executable, "-m", "rstar_hpc", "run", "status", run, "--json"],
                                       capture_output=True, text=True, env=env, timeout=120).stdout)
        assert st["done"], (label, st["stages"])
    # where the time went: the demo's phases, each run's by stage, adding up to the run's wall
    phases = out["phases"]
    assert phases["cluster"] >= 0 and phases["model"] >= 0 and phases["report"] >= 0, phases
    runs = {"sft": phases["sft_run"], **phases["rl_runs"]}
    assert set(phases["rl_runs"]) == {"roc", "grpo"}
    for key, run in runs.items():
        rows = {k: v for k, v in run.items() if k != "wall"}
        assert None not in rows.values() and all(v >= 0 for v in rows.values()), (key, run)
        assert abs(sum(rows.values()) - run["wall"]) <= 0.1 * len(rows), (key, run)
    assert list(phases["sft_run"])[:4] == ["start", "eval-base", "sft", "eval-sft"]
    assert "wall time by phase" in proc.stderr and "RL GRPO" in proc.stderr
    assert "local cluster stopped" not in proc.stderr   # it was up already: the demo leaves it up
    left = sorted(str(p.relative_to(scratch)) for p in scratch.rglob("*"))
    shutil.rmtree(scratch, ignore_errors=True)
    assert not left, f"the demo left scratch in $TMPDIR: {left[:20]}"
