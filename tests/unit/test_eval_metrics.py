"""The evaluation figures against a hand-computed set of trajectories (3 problems, k = 4, known correctness)."""
from __future__ import annotations

import math

import pytest

from rstar_hpc.eval.metrics import benchmark_metrics


def row(uid, correct, answer, tokens=10, calls=1, errors=0, p_format=0.0, finish="stop", turns=2):
    return {"prompt_uid": uid, "reward": 1.0 if correct else 0.0, "answer": answer, "response_tokens": tokens,
            "tool_calls": calls, "tool_errors": errors, "p_format": p_format, "finish_reason": finish, "turns": turns}


ROWS = [
    # a: 3 of 4 correct; majority answer "7" is right
    row("a", True, "7", tokens=10), row("a", True, "7", tokens=20), row("a", True, "7", tokens=30),
    row("a", False, "8", tokens=40, errors=1),
    # b: 1 of 4 correct; majority "5" (twice) is wrong, the right "6" once
    row("b", False, "5", calls=2, errors=2), row("b", False, "5"), row("b", True, "6", calls=2, errors=1),
    row("b", False, None, finish="length", p_format=0.5, calls=0),
    # c: none correct; no answers at all
    row("c", False, None, finish="max_turns", calls=3, errors=3, turns=5), row("c", False, None, p_format=1.0),
    row("c", False, None, calls=0), row("c", False, None, finish="tool_overflow", calls=0),
]


def test_avg_at_k_and_its_standard_error_by_hand():
    m = benchmark_metrics(ROWS)
    rates = [0.75, 0.25, 0.0]
    assert m["problems"] == 3 and m["k"] == 4
    assert m["pass1"] == pytest.approx(1 / 3)
    sd = math.sqrt(sum((x - 1 / 3) ** 2 for x in rates) / 2)
    assert m["pass1_stderr"] == pytest.approx(sd / math.sqrt(3))
    assert m["pass_at_k"] == pytest.approx(2 / 3)   # a and b have a correct sample
    assert m["maj_at_k"] == pytest.approx(1 / 3)    # only a's majority answer is right


def test_trajectory_figures_by_hand():
    m = benchmark_metrics(ROWS)
    calls = [1, 1, 1, 1, 2, 1, 2, 0, 3, 1, 0, 0]
    errors = [0, 0, 0, 1, 2, 0, 1, 0, 3, 0, 0, 0]
    assert m["tool_calls_per_trajectory"] == pytest.approx(sum(calls) / 12)
    assert m["tool_error_ratio"] == pytest.approx(sum(errors) / sum(calls))
    assert m["tool_error_ratio_positive"] == pytest.approx(1 / 5)   # correct: calls 1+1+1+2, errors 0+0+0+1
    assert m["format_violation_rate"] == pytest.approx(2 / 12)
    assert m["clip_ratio"] == pytest.approx(3 / 12)
    assert m["correct"]["trajectories"] == 4 and m["incorrect"]["trajectories"] == 8
    assert m["correct"]["response_tokens_mean"] == pytest.approx(17.5)
    assert m["correct"]["response_tokens_median"] == pytest.approx(15.0)


def test_a_problem_with_fewer_samples_counts_by_its_own_fraction():
    m = benchmark_metrics([row("x", True, "1"), row("x", False, "2"), row("y", True, "3")])
    assert m["pass1"] == pytest.approx((0.5 + 1.0) / 2) and m["k"] == [1, 2]


def test_rows_without_the_needed_keys_are_an_error():
    with pytest.raises(KeyError, match="ROW_KEYS"):
        benchmark_metrics([{"prompt_uid": "a", "reward": 1.0}])
