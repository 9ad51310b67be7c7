"""`rstar-hpc eval` without engines: what --policy resolves to, benchmark checks (before anything starts), the
composed config, and refusing to mix two evaluations in one run directory."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rstar_hpc.cli import main
from rstar_hpc.cli.exit_codes import EXIT_CONFIG
from rstar_hpc.config import ConfigError
from rstar_hpc.eval import compose as c
from rstar_hpc.exchange.rundir import RunPaths


def _hf(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({   # the tiny Qwen3's shape: the config validator reads it
        "model_type": "qwen3", "max_position_embeddings": 4096, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "vocab_size": 512}))
    (d / "model.safetensors").write_bytes(b"")
    (d / "tokenizer.json").write_text("{}")
    return d


def _publish(run: Path, version: int, stage: str, trainer_step: int) -> Path:
    dirs = RunPaths(run).policies()
    tmp = dirs.begin(version)
    _hf(tmp)
    return dirs.commit(version, tmp, stage=stage, trainer_step=trainer_step)


def _bench(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _exit(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code, capsys.readouterr().err


def test_policy_forms(tmp_path):
    hf = _hf(tmp_path / "hf")
    assert c.resolve_policy(str(hf)).hf_dir == hf
    run = tmp_path / "run"
    (run / "ckpt" / "rl").mkdir(parents=True)
    v1, v2 = _publish(run, 1, "sft", 50), _publish(run, 2, "rl", 4)
    assert c.resolve_policy(str(run)).hf_dir == v2   # a run: its newest policy
    ckpt = run / "ckpt" / "sft" / "step-00000050"
    ckpt.mkdir(parents=True)
    (ckpt / "COMMITTED.json").write_text("{}")
    pol = c.resolve_policy(str(ckpt))   # a checkpoint: the policy published at its step
    assert pol.hf_dir == v1 and "trainer step 50" in pol.what
    assert c.resolve_policy(str(ckpt.parent)).hf_dir == v1   # ckpt/<stage>: its newest
    missing = run / "ckpt" / "rl" / "step-00000009"
    missing.mkdir()   # never committed
    with pytest.raises(c.PolicyNotFound, match=r"no committed checkpoint of stage 'rl'.*committed: sft: steps 50"):
        c.resolve_policy(str(missing))
    (missing / "COMMITTED.json").write_text("{}")   # committed, its policy not kept: exported into OUT/model
    pol = c.resolve_policy(str(missing))
    assert pol.hf_dir is None and (pol.source.stage, pol.source.step) == ("rl", 9) and pol.name == "rl-step-9"
    empty = tmp_path / "empty_run"
    (empty / "policy").mkdir(parents=True)
    with pytest.raises(c.PolicyNotFound, match="without a published policy"):
        c.resolve_policy(str(empty))


def test_a_bad_policy_names_what_was_expected(tmp_path, capsys):
    bench = _bench(tmp_path / "b.jsonl", [{"question": "1+1?", "answer": "2"}])
    code, err = _exit(["eval", "--policy", str(tmp_path), "--data", str(bench)], capsys)
    assert code == EXIT_CONFIG
    assert "run directory" in err and "checkpoint" in err and "Hugging Face model directory" in err, err


def test_a_benchmark_without_answers_fails_before_anything_starts(tmp_path, capsys):
    hf = _hf(tmp_path / "hf")
    bad = _bench(tmp_path / "aime.jsonl", [{"question": "1+1?", "answer": "2"}, {"question": "2+2?"}])
    out = tmp_path / "out"
    code, err = _exit(["eval", "--policy", str(hf), "--data", str(bad), "--out", str(out)], capsys)
    assert code == EXIT_CONFIG
    assert "benchmark 'aime'" in err and str(bad) in err and "row 2" in err and "answer" in err, err
    assert not out.exists()   # nothing written, no engine started
    code, err = _exit(["eval", "--policy", str(hf), "--data", str(tmp_path / "nope.parquet")], capsys)
    assert code == EXIT_CONFIG and "no such data file" in err, err


def test_benchmark_names_and_the_composed_config(tmp_path):
    hf = _hf(tmp_path / "hf")
    a = _bench(tmp_path / "aime24.jsonl", [{"question": "1+1?", "answer": "2"}])
    b = _bench(tmp_path / "m.jsonl", [{"problem": "2+2?", "solution": "4"}])
    benches = c.parse_benchmarks([str(a), f"math500={b}"])
    assert benches == {"aime24": str(a), "math500": str(b)}
    with pytest.raises(Exception, match="two benchmarks named"):
        c.parse_benchmarks([str(a), f"aime24={b}"])
    out = tmp_path / "runs" / "ev"
    cfg = c.compose("tiny-cpu", ["rollout.engine.kv_cache_memory_mb=16"], c.resolve_policy(str(hf)), benches, out,
                    protocol={"k": 2, "temperature": None, "max_response_length": 3000}, prompts_per_step=8)
    assert cfg.run.dir == out and cfg.model.path == str(hf)
    assert (cfg.eval.k, cfg.eval.temperature, cfg.eval.max_turns, cfg.eval.max_response_length) == (2, 0.6, 30, 3000)
    [stage] = cfg.stages
    assert stage.kind == "eval" and stage.benchmarks == benches and stage.prompts_per_step == 8
    # the engine holds the prompt and the whole response budget
    assert cfg.rollout.engine.max_model_len >= cfg.rollout.agent.max_prompt_length + 3000
    assert cfg.rollout.engine.kv_cache_memory_mb == 16


def test_a_run_directory_holds_one_evaluation(tmp_path):
    from rstar_hpc.config import prepare_run_dir

    hf = _hf(tmp_path / "hf")
    a = _bench(tmp_path / "a.jsonl", [{"question": "1+1?", "answer": "2"}])
    out = tmp_path / "runs" / "ev"

    def cfg(k):
        return c.compose("tiny-cpu", [], c.resolve_policy(str(hf)), c.parse_benchmarks([str(a)]), out,
                         protocol={"k": k, "max_response_length": 2048}, prompts_per_step=8)
    prepare_run_dir(cfg(2))
    c.check_resumable(cfg(2), RunPaths(out))   # the same evaluation: a rerun resumes it
    with pytest.raises(ConfigError, match=r"another evaluation \(its eval differ"):
        c.check_resumable(cfg(4), RunPaths(out))
    shutil.rmtree(out)
    with pytest.raises(ConfigError, match=r"768 \+ --max-tokens 30000 = 30768 positions.*max_position_embeddings "
                                          r"4096: pass --max-tokens 3328 or less"):
        c.compose("tiny-cpu", [], c.resolve_policy(str(hf)), c.parse_benchmarks([str(a)]), out,
                  protocol={"k": 2, "max_response_length": 30000}, prompts_per_step=8)
    fitted = c.compose("tiny-cpu", [], c.resolve_policy(str(hf)), c.parse_benchmarks([str(a)]), out,
                       protocol={"k": 2}, prompts_per_step=8)   # no --max-tokens: the 30K default, as the model holds
    assert fitted.eval.max_response_length == 3328 and fitted.rollout.engine.max_model_len == 4096


def test_sbatch_and_submitit_go_through_launch_run(tmp_path, capsys, monkeypatch):
    from rstar_hpc.launch import launcher

    calls = []
    monkeypatch.setattr(launcher, "launch_run", lambda cfg, launcher, wait, **kw: calls.append((cfg, launcher, wait))
                        or {"status": {"done": True, "problems": []}})   # Slurm itself: tests/integration
    hf = _hf(tmp_path / "hf")
    a = _bench(tmp_path / "a.jsonl", [{"question": "1+1?", "answer": "2"}])
    out = tmp_path / "runs" / "ev"
    code, err = _exit(["eval", "--policy", str(hf), "--data", str(a), "--out", str(out), "--launcher", "submitit",
                       "--k", "3"], capsys)
    [(cfg, launcher, wait)] = calls
    assert launcher == "submitit" and wait is True and cfg.eval.k == 3 and cfg.run.dir == out
    assert (out / "config.yaml").is_file()   # the run directory the jobs read
    assert code != 0 and "not finished" in err   # the fake wrote no results
