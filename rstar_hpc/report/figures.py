"""The report's numbers: headline figures of a run and the pass@1 table rows (from eval results.json).

pass1_<label> (label: base, sft, rl, from results.json's `policy.label`) is the last eval stage of that label; over
several benchmarks it is their unweighted mean, its standard error sqrt(sum of squared stderrs) / benchmarks
(independent problem sets). positive_tool_error_ratio is the mean over RL steps of the kept positives' mean p_err
(`roc/p_err_kept_pos`): with RoC off (plain GRPO) every positive is kept, so runs compare directly.
sampled_tool_error_ratio_first/_last (and response_length_, error_share_) are means over the first and the last
quarter of the RL steps of what every sampled trajectory did (behaviour/*), whatever a mode then trained on.
sampled_per_group and trained_per_group count the rollouts each RL step sampled per prompt and trained per prompt
that trained at all, over every step of the run: an ablation is fair when trained_per_group agrees across modes.
"""
from __future__ import annotations

import math

from rstar_hpc.report.rundata import RunData

LABELS = ("base", "sft", "rl")


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _ratio(num: list[float], den: list[float]) -> float | None:
    """sum(num) / sum(den) over the RL steps (a per-group mean over the whole run, not a mean of step means)."""
    return sum(num) / sum(den) if sum(den) > 0 else None


def _ends(xs: list[float], parts: int = 10) -> tuple[float | None, float | None]:
    """Means of the first and last 1/`parts` (at least one value) of `xs`: tenths, or quarters with parts=4."""
    n = max(1, len(xs) // parts)
    return (_mean(xs[:n]), _mean(xs[-n:])) if xs else (None, None)


def pass1_of(results: dict) -> tuple[float | None, float | None]:
    """pass@1 and its standard error of one eval stage, over its benchmarks."""
    ms = [m for m in results.get("benchmarks", {}).values() if isinstance(m.get("pass1"), (int, float))]
    if not ms:
        return None, None
    errs = [m.get("pass1_stderr") for m in ms]
    err = math.sqrt(sum(e * e for e in errs)) / len(ms) if all(isinstance(e, (int, float)) for e in errs) else None
    return sum(m["pass1"] for m in ms) / len(ms), err


def headline(run: RunData) -> dict:
    out: dict = {"run": str(run.paths.dir), "label": run.label, "rl_stages": run.rl_stages,
                 "rl_steps": max((x for x, _ in run.series.get("mean_reward", [])), default=0)}
    out["mean_reward_first"], out["mean_reward_last"] = _ends(run.values("mean_reward"))
    out["positive_tool_error_ratio"] = _mean(run.values("pos_tool_error_kept"))
    out["positive_tool_error_ratio_all"] = _mean(run.values("pos_tool_error_all"))
    out["sampled_per_group"] = _ratio(run.values("num_trajectories"), run.values("num_groups"))
    out["trained_per_group"] = _ratio(run.values("num_kept"), run.values("groups_trained"))
    out["tool_calls_per_trajectory_last"] = _ends(run.values("tool_calls"))[1]
    out["sampled_tool_error_ratio_first"], out["sampled_tool_error_ratio_last"] = _ends(
        run.values("sampled_tool_error"), 4)
    out["error_share_first"], out["error_share_last"] = _ends(run.values("error_share"), 4)
    # does outcome reward already punish an error? the pass rates with and without one, as RL starts
    out["pass_rate_clean_first"] = _ends(run.values("pass_rate_clean"), 4)[0]
    out["pass_rate_after_error_first"] = _ends(run.values("pass_rate_after_error"), 4)[0]
    out["response_length_first"], out["response_length_last"] = _ends(run.values("response_length"), 4)
    out["step_time_mean_s"] = _mean(run.values("time_step"))
    for label in LABELS:
        mine = [r for r in run.evals if (r.get("policy") or {}).get("label") == label]
        p, err = pass1_of(mine[-1]) if mine else (None, None)
        out[f"pass1_{label}"], out[f"pass1_{label}_stderr"] = p, err
        out[f"pass1_{label}_stage"] = mine[-1]["stage"] if mine else None
    return out


def pass1_rows(runs: list[RunData]) -> list[list[str]]:
    """One row per run, eval stage and benchmark: the pass@1 table."""
    rows = []
    for run in runs:
        for r in run.evals:
            policy = r.get("policy") or {}
            where = "base model" if policy.get("stage") is None else \
                f"{policy['stage']} step {policy.get('trainer_step', '?')}"
            for bench, m in r["benchmarks"].items():
                rows.append([run.label, r["stage"], str(policy.get("label", "?")), where, bench,
                             fmt(m.get("problems")), fmt(m.get("k")), fmt(m.get("pass1")),
                             fmt(m.get("pass1_stderr")), fmt(m.get("pass_at_k")),
                             fmt(m.get("tool_error_ratio_positive"))])
    return rows


PASS1_HEADER = ["run", "eval stage", "model", "policy", "benchmark", "problems", "k", "pass@1", "± stderr",
                "pass@k", "tool error ratio (correct)"]


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)
