"""The metrics sink (JSONL unchanged + TensorBoard) and `rstar-hpc report`, on run directories written by the real
sink, the real RoC metrics and the real eval figures."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from rstar_hpc.algo.metrics import behaviour_metrics, response_length_metrics, roc_metrics
from rstar_hpc.algo.roc import roc_downsample
from rstar_hpc.cli import cli
from rstar_hpc.config.algo import RoCConfig
from rstar_hpc.eval.metrics import benchmark_metrics
from rstar_hpc.eval.results import markdown
from rstar_hpc.exchange.atomic import atomic_write_json, atomic_write_text
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.metrics_log import MetricsSink, tb_tag

PNG = b"\x89PNG\r\n\x1a\n"
STEPS = 5
PLOTS = ["reward.png", "pass1.png", "positive_tool_error.png", "sampled_tool_error.png", "error_share.png",
         "response_length.png", "tool_calls.png", "sandbox_lost.png", "logprob_mismatch.png", "step_time.png"]


def _trainer_record(rng, roc: RoCConfig, step: int) -> dict:
    """What trainer/rl.py logs for one RL step: RoC on 4 prompts x 8 rollouts, lengths, timings."""
    uids = np.repeat([f"p{i}" for i in range(4)], 8)
    rewards = (rng.random(32) < 0.2 + 0.1 * min(step, 5)).astype(float)
    p_err, p_format = rng.random(32) * 0.5, np.zeros(32)
    sel = roc_downsample(uids, rewards, p_err, p_format, roc, seed=step)
    # one call each, failing less often step by step: a policy that learns to err less
    statuses = np.where(rng.random(32) < 0.6 - 0.1 * step, "error", "ok")
    return {"reward/mean": float(rewards.mean()), **roc_metrics(sel, rewards, p_err, p_format),
            **behaviour_metrics(rewards, statuses, np.arange(33)),
            **response_length_metrics(rng.integers(50, 400, 32), rng.random(32) < 0.1),
            "train/logprob_mismatch_mean": 1e-3, "train/logprob_mismatch_max": 2e-2,
            "loss": 0.5 / step, "time/read(s)": 0.5, "time/train(s)": 2.0, "time/publish(s)": 0.3,
            "time/checkpoint(s)": 0.4 if step % 2 == 0 else 0.0, "time/step(s)": 3.2}


def _write_run(root, name: str, roc: RoCConfig, seed: int, evals: bool = True) -> RunPaths:
    paths = RunPaths(root / name)
    paths.create(stripe=False)
    stages = [("eval_base", "eval", 1), ("sft", "sft", 3), ("eval_sft", "eval", 1), ("rl1", "rl", STEPS),
              ("eval_rl", "eval", 1)]
    paths.config.write_text("stages:\n" + "".join(f"  - {{name: {n}, kind: {k}, num_steps: {s}}}\n"
                                                   for n, k, s in stages))
    rng = np.random.default_rng(seed)
    trainer, rollout = MetricsSink(paths, "trainer"), MetricsSink(paths, "rollout")
    for step in range(1, 4):
        trainer.write({"stage": "sft", "step": step, "time": 1e9 + step, "loss": 1.0 / step, "time/step(s)": 1.0})
    for step in range(1, STEPS + 1):
        rec = _trainer_record(rng, roc, step)
        clean = {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in rec.items()}
        trainer.write({"stage": "rl1", "step": step, "time": 1e9 + 10 + step, **clean})
        rollout.write({"step": step - 1, "stage": "rl1", "trajectories": 32, "wall_s": 9.0, "generation_wall_s": 8.0,
                       "reward_s": 0.2, "tool_wait_s": 30.0, "generate_s": 90.0, "mean_reward": rec["reward/mean"],
                       "tool_calls_per_trajectory": 1.5 + 0.1 * step, "tool_error_ratio": 0.2,
                       "finish_reasons": {"stop": 30, "length": 2}, "dead_engines": [],
                       "tool_infra_failures": 2 if step == 3 else 0, "infra_reruns": 2 if step == 3 else 0})
    trainer.close()
    rollout.close()
    if evals:
        for stage, label, policy_stage, tstep, p in (("eval_base", "base", None, None, 0.1),
                                                     ("eval_sft", "sft", "sft", 3, 0.3), ("eval_rl", "rl", "rl1",
                                                                                          STEPS, 0.6)):
            _write_eval(paths, stage, label, policy_stage, tstep, p, rng)
    return paths


def _write_eval(paths: RunPaths, stage: str, label: str, policy_stage, trainer_step, p: float, rng) -> None:
    """results.json as rstar_hpc.eval.results.write_eval_results writes it, from real benchmark figures."""
    rows = [{"prompt_uid": f"q{i}", "reward": float(rng.random() < p), "answer": "1", "response_tokens": 100,
             "tool_calls": 2, "tool_errors": int(rng.random() < 0.3), "p_format": 0.0, "finish_reason": "stop",
             "turns": 2} for i in range(40) for _ in range(4)]
    results = {"stage": stage, "k": 4, "protocol": {"temperature": 0.6, "top_p": 1.0, "max_turns": 4,
                                                    "max_response_length": 512},
               "policy": {"version": None, "stage": policy_stage, "trainer_step": trainer_step, "label": label},
               "benchmarks": {"arith": benchmark_metrics(rows)}}
    folder = paths.eval_dir(stage)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / "results.json", results)
    atomic_write_text(folder / "results.md", markdown(results))
    MetricsSink(paths, "eval").write({"stage": stage, "benchmark": "arith", **{
        k: v for k, v in results["benchmarks"]["arith"].items() if not isinstance(v, dict)}},
        step=trainer_step or 0, group="arith")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    roc = RoCConfig(down_sample_to_n=4, min_zero_reward_trace_num=1, min_non_zero_reward_trace_num=1)
    return (_write_run(root, "roc", roc, seed=0),
            _write_run(root, "grpo", RoCConfig(mode="grpo", down_sample_to_n=8), seed=1, evals=False))


def test_the_sink_keeps_the_jsonl_exactly(tmp_path):
    paths = RunPaths(tmp_path)
    record = {"stage": "rl", "step": 2, "time": 1.5, "loss": None, "time/step(s)": 1.0, "nested": {"a": 1}}
    MetricsSink(paths, "trainer", tensorboard=False).write(record)
    assert paths.metrics("trainer").read_text() == json.dumps(record) + "\n"
    assert not paths.tb_root.exists()
    assert tb_tag("time/step(s)") == "time/step_s" and tb_tag("response/length_mean(tokens)") == \
        "response/length_mean_tokens"


def test_tensorboard_has_every_role_tag_and_step(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    roc, _ = runs
    rl = EventAccumulator(str(roc.tb_dir("rl1")))
    rl.Reload()
    tags = rl.Tags()["scalars"]
    assert {"trainer/reward/mean", "trainer/roc/p_err_kept_pos", "trainer/time/train_s", "rollout/mean_reward",
            "rollout/tool_calls_per_trajectory", "rollout/finish_reasons/length"} <= set(tags)
    assert [e.step for e in rl.Scalars("trainer/reward/mean")] == list(range(1, STEPS + 1))
    assert [e.step for e in rl.Scalars("rollout/mean_reward")] == list(range(STEPS))
    assert "trainer/step" not in tags and not any(t.endswith("dead_engines") for t in tags)
    ev = EventAccumulator(str(roc.tb_dir("eval_sft")))
    ev.Reload()
    assert [(e.step, round(e.value, 6)) for e in ev.Scalars("eval/arith/pass1")] == [
        (3, round(json.loads((roc.eval_dir("eval_sft") / "results.json").read_text())
                  ["benchmarks"]["arith"]["pass1"], 6))]


def test_a_second_process_appends_a_new_event_file(tmp_path):
    """A requeued job writes beside the old event file; TensorBoard reads both."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    paths = RunPaths(tmp_path)
    for step in (1, 2):
        sink = MetricsSink(paths, "trainer")
        sink.write({"stage": "rl", "step": step, "loss": float(step)})
        sink.close()
    assert len(list(paths.tb_dir("rl").iterdir())) == 2
    acc = EventAccumulator(str(paths.tb_dir("rl")))
    acc.Reload()
    assert sorted(e.step for e in acc.Scalars("trainer/loss")) == [1, 2]   # files of one second: any order


def test_report_renders_plots_table_and_compared_run(runs, tmp_path):
    roc, grpo = runs
    out = tmp_path / "report"
    result = CliRunner().invoke(cli, ["report", str(roc.dir), "--label", "RoC", "--compare", f"GRPO={grpo.dir}",
                                      "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == PNG, name
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert "| pass@1 | ± stderr |" in md and "GRPO" in md and "GRPO" in page
    table = [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines() if line.startswith("| RoC |")]
    assert [row[2] for row in table] == ["base", "sft", "rl"]          # one pass@1 row per model, in order
    assert all(0 < float(row[8]) < 0.2 and 0 < float(row[7]) < 1 for row in table)   # pass@1 and its stderr
    for name in PLOTS:
        assert f"src='{name}'" in page and f"({name})" in md
    head = json.loads(result.output.strip().splitlines()[-1])
    assert head["pass1_rl"] > head["pass1_sft"] > head["pass1_base"] and head["pass1_rl_stderr"] > 0
    assert head["rl_steps"] == STEPS and head["report"] == str(out / "report.md")
    assert head["compare"]["GRPO"]["positive_tool_error_ratio"] is not None
    assert head["compare"]["GRPO"]["pass1_rl"] is None
    # what the sampled trajectories did, first and last quarter of the RL steps (here step 1 and step 5)
    assert head["sampled_tool_error_ratio_first"] > head["sampled_tool_error_ratio_last"]
    assert head["response_length_first"] > 0 and head["compare"]["GRPO"]["error_share_last"] is not None
    assert "tool-error ratio of sampled trajectories, first quarter" in md
    # counted from what each step sampled and trained: RoC keeps 4 of 8, this GRPO run trains its 8 whole
    assert (head["sampled_per_group"], head["trained_per_group"]) == (8, 4)
    assert (head["compare"]["GRPO"]["sampled_per_group"], head["compare"]["GRPO"]["trained_per_group"]) == (8, 8)


def test_report_skips_what_is_missing_with_a_note(tmp_path):
    paths = RunPaths(tmp_path / "partial")
    MetricsSink(paths, "trainer", tensorboard=False).write({"stage": "rl", "step": 1, "reward/mean": 0.5})
    with open(paths.metrics("trainer"), "a") as f:
        f.write('{"stage": "rl", "step": 2, "rew')   # a job killed mid-line
    result = CliRunner().invoke(cli, ["report", str(paths.dir)])
    assert result.exit_code == 0, result.output
    assert (paths.report_dir / "reward.png").exists() and not (paths.report_dir / "pass1.png").exists()
    md = (paths.report_dir / "report.md").read_text()
    assert "no eval/<stage>/results.json" in md and "torn last line" in md and "(reward.png)" in md


def test_a_run_without_metrics_gets_a_clear_message(tmp_path):
    RunPaths(tmp_path / "empty").create(stripe=False)
    result = CliRunner().invoke(cli, ["report", str(tmp_path / "empty")])
    assert result.exit_code == 1
    assert "nothing to report yet" in result.output and "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    missing = CliRunner().invoke(cli, ["report", str(tmp_path / "nope")])
    assert missing.exit_code == 4 and "no run directory" in missing.output
    bad = CliRunner().invoke(cli, ["report", str(tmp_path / "empty"), "--compare", "GRPO"])
    assert bad.exit_code == 2 and "LABEL=RUN" in bad.output


def test_run_phases_add_up_to_the_wall_between_stage_ends(tmp_path):
    from rstar_hpc.exchange.state import StageState, write_stage_state
    from rstar_hpc.report.phases import phase_line, run_phases

    paths = RunPaths(tmp_path / "run")
    paths.allocation.parent.mkdir(parents=True)
    atomic_write_json(paths.allocation, {"job": "1", "restart": 0, "time": 1000.0, "nodes": {}})
    # eval-base ends while the trainer trains (overlapping stages); eval-sft after sft; the RL stage never ran
    for name, done in (("eval-base", 1025.0), ("sft", 1240.0), ("eval-sft", 1281.5)):
        write_stage_state(paths, StageState(stage=name, status="DONE", updated_at=done))
    got = run_phases(paths, ["eval-base", "sft", "eval-sft"], submitted_at=997.0, ended_at=1286.0)
    assert got == {"start": 3.0, "eval-base": 25.0, "sft": 215.0, "eval-sft": 41.5, "end": 4.5, "wall": 289.0}
    assert sum(v for k, v in got.items() if k != "wall") == pytest.approx(got["wall"])
    assert phase_line(got) == "start 3 | eval-base 25 | sft 215 | eval-sft 42 | end 4"
    # a stage not done shows as None; a run whose job never started counts from its submission
    write_stage_state(paths, StageState(stage="rl", status="RUNNING", updated_at=1300.0))
    assert run_phases(paths, ["eval-base", "rl"], submitted_at=997.0, ended_at=1300.0)["rl"] is None
    bare = run_phases(RunPaths(tmp_path / "never"), ["sft"], submitted_at=5.0, ended_at=9.0)
    assert bare == {"start": None, "sft": None, "end": 4.0, "wall": 4.0}
    # launched again once done (its job started before this submission): the stages as they ran, no start, end or
    # wall of this submission (a demo run again over its runs printed an "end" of hours)
    again = run_phases(paths, ["eval-base", "sft", "eval-sft"], submitted_at=20_000.0, ended_at=20_010.0)
    assert again == {"start": None, "eval-base": 25.0, "sft": 215.0, "eval-sft": 41.5, "end": None, "wall": None}
    assert phase_line(again) == "start - | eval-base 25 | sft 215 | eval-sft 42 | end -"
