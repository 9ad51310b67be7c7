"""The paper's evaluation figures for one benchmark, from its sampled trajectories (k per problem).

    pass@1 (avg@k)   mean over problems of the fraction of its k samples that are correct; `pass1_stderr` is
                     the standard error of that mean over problems (sample standard deviation / sqrt(problems))
    pass@k           a problem counts if any of its k samples is correct (the unbiased estimator with n = k)
    maj@k            a problem counts if the most frequent extracted answer among its samples is correct
                     (ties: the answer seen first; samples without an answer do not vote)
    tokens           model-generated response tokens (tool responses excluded), mean and median
    tool calls       per trajectory; the tool error ratio is errored calls / calls, over all trajectories and
                     over the correct ones only (the paper's "positive" trajectories, the ones RoC cares about)
    format           share of trajectories with a format violation (RoC's p_format > 0)
    clip             share cut short: out of response budget, turns, or room for the next tool response
    turns            assistant turns used
and `correct` / `incorrect`: the per-trajectory figures over each subset. Pure functions over plain rows, so a
hand-computed case pins them (tests/unit/test_eval_metrics.py).
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable

CLIPPED = ("length", "max_turns", "tool_overflow")
ROW_KEYS = ("prompt_uid", "reward", "answer", "response_tokens", "tool_calls", "tool_errors", "p_format",
            "finish_reason", "turns")


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    mid = len(s) // 2
    return float(s[mid]) if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def trajectory_figures(rows: list[dict]) -> dict:
    """Per-trajectory figures over `rows` (any subset of a benchmark's trajectories)."""
    calls = sum(r["tool_calls"] for r in rows)
    errors = sum(r["tool_errors"] for r in rows)
    tokens = [r["response_tokens"] for r in rows]
    return {
        "trajectories": len(rows),
        "response_tokens_mean": _mean(tokens),
        "response_tokens_median": _median(tokens),
        "tool_calls_per_trajectory": _mean([r["tool_calls"] for r in rows]),
        "tool_error_ratio": errors / calls if calls else None,
        "format_violation_rate": _mean([float(r["p_format"] > 0) for r in rows]),
        "clip_ratio": _mean([float(r["finish_reason"] in CLIPPED) for r in rows]),
        "turns_mean": _mean([r["turns"] for r in rows]),
    }


def majority_correct(samples: list[dict]) -> bool:
    votes = Counter(r["answer"] for r in samples if r["answer"] is not None)
    if not votes:
        return False
    best = max(votes.values())
    winner = next(r["answer"] for r in samples if r["answer"] is not None and votes[r["answer"]] == best)
    return any(r["reward"] > 0 for r in samples if r["answer"] == winner)


def benchmark_metrics(rows: Iterable[dict]) -> dict:
    """Every figure of one benchmark from its trajectories (dicts with ROW_KEYS)."""
    rows = list(rows)
    missing = [k for k in ROW_KEYS if rows and k not in rows[0]]
    if missing:
        raise KeyError(f"trajectory rows lack {missing}; see rstar_hpc.eval.metrics.ROW_KEYS")
    by_problem: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_problem[r["prompt_uid"]].append(r)
    rates = [sum(r["reward"] > 0 for r in s) / len(s) for s in by_problem.values()]
    n = len(rates)
    pass1 = _mean(rates)
    stderr = (math.sqrt(sum((x - pass1) ** 2 for x in rates) / (n - 1) / n) if n > 1 else 0.0) if n else None
    correct = [r for r in rows if r["reward"] > 0]
    incorrect = [r for r in rows if r["reward"] <= 0]
    ks = sorted({len(s) for s in by_problem.values()})
    return {
        "problems": n,
        "k": ks[0] if len(ks) == 1 else ks,
        "pass1": pass1,
        "pass1_stderr": stderr,
        "pass_at_k": _mean([float(any(r["reward"] > 0 for r in s)) for s in by_problem.values()]),
        "maj_at_k": _mean([float(majority_correct(s)) for s in by_problem.values()]),
        **trajectory_figures(rows),
        "tool_error_ratio_positive": trajectory_figures(correct)["tool_error_ratio"],
        "correct": trajectory_figures(correct),
        "incorrect": trajectory_figures(incorrect),
    }
