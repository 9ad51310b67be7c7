"""An eval stage's output, from its committed trajectories: `eval/<stage>/results.json` (one object, stable keys),
`eval/<stage>/results.md` (a table) and one line per benchmark appended to `metrics/eval.jsonl`.

results.json:
    {"stage": str, "k": int,
     "protocol": {"temperature": float, "top_p": float, "max_turns": int, "max_response_length": int},
     "policy": {"version": int | null, "stage": str | null, "trainer_step": int | null,
                "label": "base" | "sft" | "rl", "model": str},
     "benchmarks": {name: {...}}}
`policy`: what generated the trajectories. `label` "base" is the run's model itself (`rstar-hpc eval` puts the
policy it evaluates there), whose directory `model` names; otherwise the policy version published by trainer stage
`stage` at `trainer_step` (`model` then names the run's base model). Each benchmark (rstar_hpc.eval.metrics):
    problems                  problems with trajectories
    k                         samples per problem (a list if they differ: some prompts dropped as too long)
    pass1, pass1_stderr       avg@k pass@1 and its standard error over problems
    pass_at_k, maj_at_k       any sample correct; the majority answer correct
    trajectories              problems x k
    response_tokens_mean, response_tokens_median       model tokens per trajectory (tool outputs excluded)
    tool_calls_per_trajectory, tool_error_ratio        errored calls / calls, over all trajectories
    tool_error_ratio_positive                          ... over the correct ones only
    format_violation_rate, clip_ratio, turns_mean      format violations, cut short (budget, turns), turns used
    correct, incorrect        {trajectories, response_tokens_mean, response_tokens_median, tool_calls_per_trajectory,
                               tool_error_ratio, format_violation_rate, clip_ratio, turns_mean} of each subset
Ratios are in [0, 1]; a figure over no trajectories (no tool call, no correct sample) is null.
The per-trajectory rows stay in traj/<stage>/step-*/ (`rstar-hpc traj show RUN --stage <stage> --step N`).
"""
from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable

from rstar_hpc import pipeline
from rstar_hpc.config.stages import StageConfig
from rstar_hpc.eval.metrics import benchmark_metrics
from rstar_hpc.exchange.atomic import atomic_write_json, atomic_write_text
from rstar_hpc.exchange.columns import from_table
from rstar_hpc.exchange.reader import StepReader
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.metrics_log import metrics_sink


def trajectory_row(t) -> dict:
    """The fields benchmark_metrics reads, from one trajectory."""
    return {"prompt_uid": t.prompt_uid.partition("/")[2] or t.prompt_uid, "reward": float(t.reward),
            "answer": t.answer, "response_tokens": int(sum(t.loss_mask)), "tool_calls": len(t.tool_calls),
            "tool_errors": sum(c.is_error for c in t.tool_calls), "p_format": float(t.p_format),
            "finish_reason": t.finish_reason, "turns": sum(turn.role == "assistant" for turn in t.turns)}


def collect(paths: RunPaths, stage: str, steps: int | Iterable[int]) -> tuple[dict[str, list[dict]], list[int]]:
    """Rows by benchmark (uids are "<benchmark>/<uid>"), and the policy versions that generated them, over the
    first `steps` steps (or those listed)."""
    reader = StepReader(paths, stage)
    rows: dict[str, list[dict]] = defaultdict(list)
    versions = []
    for step in (range(steps) if isinstance(steps, int) else steps):
        for t in from_table(reader.read(step, [pipeline.PRODUCER])):
            rows[t.prompt_uid.partition("/")[0]].append(trajectory_row(t))
            versions.append(int(t.policy_version))
    return rows, versions


def policy_label(cfg, need: pipeline.PolicyNeed) -> str:
    return "base" if need.stage is None else cfg.stage(need.stage).kind


def write_eval_results(cfg, paths: RunPaths, stage_cfg: StageConfig, num_steps: int) -> dict:
    rows, versions = collect(paths, stage_cfg.name, num_steps)
    need = pipeline.starting_policy(cfg, stage_cfg.name)
    limits = cfg.stage_limits(stage_cfg)
    results = {
        "stage": stage_cfg.name, "k": pipeline.sample_count(cfg, stage_cfg),
        "protocol": {"temperature": limits.temperature, "top_p": limits.top_p, "max_turns": limits.max_turns,
                     "max_response_length": limits.max_response_length},
        "policy": {"version": max(versions) if need.stage is not None and versions else None, "stage": need.stage,
                   "trainer_step": need.trainer_step if need.stage is not None else None,
                   "label": policy_label(cfg, need), "model": str(cfg.model_dir())},
        "benchmarks": {name: benchmark_metrics(r) for name, r in sorted(rows.items())},
    }
    folder = paths.eval_dir(stage_cfg.name)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / "results.json", results)
    atomic_write_text(folder / "results.md", markdown(results))
    sink = metrics_sink(paths, "eval")   # metrics/eval.jsonl, and tb/<stage>/ at the policy's trainer step
    for name, m in results["benchmarks"].items():
        sink.write({"stage": stage_cfg.name, "benchmark": name, "policy_version": results["policy"]["version"],
                    "policy_stage": need.stage, "trainer_step": results["policy"]["trainer_step"],
                    "label": results["policy"]["label"], **{k: v for k, v in m.items() if not isinstance(v, dict)}},
                   step=results["policy"]["trainer_step"] or 0, group=name)
    summary = "; ".join(f"{name} pass@1 {m['pass1']:.3f} ± {m['pass1_stderr']:.3f}"
                        for name, m in results["benchmarks"].items())
    return {**results, "summary": summary}


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def markdown(results: dict) -> str:
    p = results["policy"]
    lines = [f"# Evaluation: stage {results['stage']}", "",
             f"Policy: {p['label']} (stage {p['stage'] or '-'}, trainer step {_fmt(p['trainer_step'])}, version "
             f"{_fmt(p['version'])}). Protocol: avg@{results['k']}, " + ", ".join(
                 f"{k} {_fmt(v)}" for k, v in results["protocol"].items()), "",
             "| benchmark | problems | pass@1 | ± stderr | pass@k | maj@k | tokens (mean) | tool calls/traj | "
             "tool error ratio | (correct only) | format violations | clipped | turns |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in results["benchmarks"].items():
        lines.append("| " + " | ".join([name] + [_fmt(m[k]) for k in (
            "problems", "pass1", "pass1_stderr", "pass_at_k", "maj_at_k", "response_tokens_mean",
            "tool_calls_per_trajectory", "tool_error_ratio", "tool_error_ratio_positive", "format_violation_rate",
            "clip_ratio", "turns_mean")]) + " |")
    return "\n".join(lines) + "\n"


def read_results(paths: RunPaths, stage: str) -> dict | None:
    try:
        return json.loads((paths.eval_dir(stage) / "results.json").read_text())
    except FileNotFoundError:
        return None


def read_val_results(paths: RunPaths, stage: str) -> list[dict]:
    """The validation passes of rl stage `stage` (eval/<stage>/val/step-*.json, rstar_hpc/rollout/validation.py),
    by step."""
    folder = paths.val_results(stage, 0).parent
    return [json.loads(f.read_text()) for f in sorted(folder.glob("step-*.json"))] if folder.is_dir() else []
