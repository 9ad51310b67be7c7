"""Every bench script runs from the checkout: `python bench/X.py --quick` from the repository root, exit status 0,
and the last stdout line one JSON object of its figures (the contract every bench keeps).

The scripts are found by globbing bench/ for files with a `__main__` block, so a new bench is covered the day it
lands; modules without one (trainer_sized.py) are run through the scripts that import them.
`--quick` is each bench's smoke size: seconds on a 2-core machine, figures that only show the bench works.

Each runs with TMPDIR set to an empty folder of its own, which must be empty afterwards: a bench's scratch (models,
checkpoints, run directories) and what its libraries put in $TMPDIR (vLLM's IPC sockets, torch's kernel cache)
go when it ends (rstar_hpc/scratch.py, rstar_hpc/rollout/engine.py).

exchange.py's exit status reports its target (1 when Arrow misses 5x JSONL), which a toy step need not meet: for it
status 1 is accepted, but only when the JSON line parses and says the target was missed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# demo_path.py runs the demo through a Slurm cluster (minutes even at --quick): its quick size is the run of
# tests/integration/test_demo.py, which checks the phases it reads; its arithmetic is checked below
CLUSTER_BENCHES = {"demo_path.py"}
SCRIPTS = sorted(p.name for p in (REPO / "bench").glob("*.py")
                 if "if __name__ == \"__main__\":" in p.read_text() and p.name not in CLUSTER_BENCHES)
TARGET_FLAG = {"exchange.py": "meets_target"}   # exit status 1 = this figure is false
TIMEOUT_S = 300                                 # each takes seconds; a loaded 2-core machine gets a wide margin


def _run(script: str, *args: str, tmpdir: Path | None = None) -> tuple[int, dict, str]:
    env = None if tmpdir is None else {**os.environ, "TMPDIR": str(tmpdir)}
    done = subprocess.run([sys.executable, f"bench/{script}", "--quick", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=TIMEOUT_S, env=env)
    lines = done.stdout.strip().splitlines()
    assert lines, f"bench/{script} printed nothing (exit {done.returncode}):\n{done.stderr[-3000:]}"
    try:
        figures = json.loads(lines[-1])
    except json.JSONDecodeError:
        pytest.fail(f"bench/{script}: the last stdout line is not JSON: {lines[-1][:300]!r}\n{done.stderr[-3000:]}")
    assert isinstance(figures, dict), f"bench/{script}: the last stdout line is not a JSON object"
    return done.returncode, figures, done.stderr


def test_the_glob_finds_the_benches():
    assert {"exchange.py", "logprobs.py", "roc.py", "rollout_balance.py", "sandbox_service.py", "trainer.py"} <= \
        set(SCRIPTS)
    assert "trainer_sized.py" not in SCRIPTS   # a module of trainer.py, no script
    assert all((REPO / "bench" / name).is_file() for name in CLUSTER_BENCHES)


def test_demo_path_figures_put_each_runs_wall_beside_its_roles_work(tmp_path):
    """bench/demo_path.py's figures from a demo summary: the work is the trainer's compute (not its waits) plus the
    rollout's generation, from the runs' own metrics; wall / work is the path's overhead."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_path", REPO / "bench" / "demo_path.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    runs = {}
    for name, trainer, rollout in (("sft", [{"time/train(s)": 0.5, "time/read(s)": 9.0}] * 4,
                                    [{"generation_wall_s": 3.0}]),
                                   ("roc", [{"time/train(s)": 1.0, "time/publish(s)": 0.1, "time/read(s)": 4.0,
                                             "time/checkpoint(s)": 0.4}] * 2, [{"generation_wall_s": 2.5}] * 2)):
        (tmp_path / name / "metrics").mkdir(parents=True)
        for role, rows in (("trainer", trainer), ("rollout", rollout)):
            (tmp_path / name / "metrics" / f"{role}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs[name] = str(tmp_path / name)
    summary = {"runs": {"SFT": runs["sft"], "RoC": runs["roc"]},
               "phases": {"sft_run": {"start": 2.0, "sft": 8.0, "end": 1.0, "wall": 11.0},
                          "rl_runs": {"roc": {"start": 2.0, "rl": 15.0, "end": 1.0, "wall": 18.0}}}}
    got = bench.figures(summary)
    assert got["sft"]["work_s"] == 5.0 and got["sft"]["overhead_ratio"] == 2.2
    assert got["roc"]["trainer_s"] == 3.0 and got["roc"]["rollout_s"] == 5.0 and got["roc"]["overhead_ratio"] == 2.25
    assert got["roc"]["phases"] == {"start": 2.0, "rl": 15.0, "end": 1.0}


@pytest.fixture
def short_tmpdir(tmp_path_factory) -> Path:
    """An empty folder for TMPDIR with a short path: an engine's IPC sockets under it must fit a socket path's
    107 bytes (pytest's tmp_path is ~60 characters already)."""
    return tmp_path_factory.mktemp("t", numbered=True)


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_quick_runs_and_ends_with_its_figures(script, tmp_path, short_tmpdir):
    extra = ("--dir", str(tmp_path)) if script == "exchange.py" else ()
    rc, figures, stderr = _run(script, *extra, tmpdir=short_tmpdir)
    left = sorted(str(p.relative_to(short_tmpdir)) for p in short_tmpdir.rglob("*"))
    assert not left, f"bench/{script} left in $TMPDIR: {left[:20]}"
    flag = TARGET_FLAG.get(script)
    if flag is not None:
        assert rc == (0 if figures[flag] else 1), f"bench/{script}: exit {rc} with {flag}={figures[flag]}"
    else:
        assert rc == 0, f"bench/{script}: exit {rc}:\n{stderr[-3000:]}"
    if script == "logprobs.py":   # both paths ran and computed the same loss and weight gradient
        assert figures["peak_ratio"] > 0 and figures["speed_ratio"] > 0
        assert figures["loss_rel_diff"] < 1e-5 and figures["weight_grad_rel_diff"] < 1e-5
    if script == "exchange.py":   # what tests/unit/test_exchange_bench.py checked
        for fmt in ("arrow", "jsonl", "parquet"):
            assert figures[fmt]["bytes"] > 0 and figures[fmt]["write_s"] > 0
        assert figures["trajectories"] == 128
        assert figures["arrow_vs_jsonl_total"] > 1   # the 5x target is checked at full size by the exit status
        assert list(tmp_path.iterdir()) == []        # cleans up after itself


@pytest.mark.slow
def test_bench_trainer_sized_path_runs_on_the_cpu(short_tmpdir):
    """bench/trainer.py's realistic-size path (bench/trainer_sized.py), one layer of Qwen3-0.6B's shape on the
    CPU: about a minute on 2 cores, hence `slow`."""
    rc, figures, stderr = _run("trainer.py", "--model", "qwen3-0.6b", tmpdir=short_tmpdir)
    assert rc == 0, stderr[-3000:]
    assert list(short_tmpdir.iterdir()) == []
    assert figures["bench"] == "trainer_sft_step_sized" and figures["layers"] == 1
    assert figures["megatron_tokens_per_s"] > 0
