"""Reward: answer extraction, the integer fast path, math-verify, and the hard time limit."""
import os
import threading
import time

import pydantic
import pytest

from rstar_hpc.algo import RewardScorer, extract_answer, last_boxed, math_reward, score_response
from rstar_hpc.algo._verify_pool import VerifierPool

TIMEOUT_S = 1.5
POW_TOWER = r"9^{9^{9^{9}}}"
DEEP_FRAC = r"\frac{1}{" * 5000 + "2" + "}" * 5000


def ans(x: str) -> str:
    return f"<reason>work</reason>\n<answer>The answer is \\boxed{{{x}}}.</answer><|im_end|>"


@pytest.fixture(scope="module")
def scorer():
    with RewardScorer(timeout_s=TIMEOUT_S, num_workers=2) as s:
        yield s


@pytest.mark.parametrize("response, mode, expected", [
    (ans("42"), "answer_tag", "42"),
    (r"<answer>\boxed{1} then \boxed{\frac{1}{2}}</answer>", "answer_tag", r"\frac{1}{2}"),
    (r"<answer>\boxed{1}</answer> more <answer>\boxed{2}</answer>", "answer_tag", "2"),
    (r"<answer>\boxed{1}</answer> more <answer>no box</answer>", "answer_tag", "1"),
    (r"\boxed{7} <answer>seven</answer>", "answer_tag", None),  # boxed outside <answer>
    (r"\boxed{7} <answer>seven</answer>", "last_boxed", "7"),
    (r"<answer>\boxed{7}", "answer_tag", None),  # truncated: <answer> never closed
    (r"<answer>\boxed{7}", "last_boxed", "7"),
    (r"<tool_response>\boxed{9}</tool_response> \boxed{3}", "last_boxed", "3"),
    (r"\boxed{3} <tool_response>\boxed{9}</tool_response>", "last_boxed", "3"),  # tool output is not an answer
    (r"<answer>\fbox{ 12 }</answer>", "answer_tag", "12"),
    (r"<answer>\boxed{\{1,2\}} \boxed{oops</answer>", "answer_tag", r"\{1,2\}"),  # unbalanced last box skipped
    ("no answer at all", "last_boxed", None),
])
def test_extract_answer(response, mode, expected):
    assert extract_answer(response, mode) == expected


def test_extract_answer_rejects_unknown_mode():
    with pytest.raises(ValueError, match="answer_tag"):
        extract_answer("x", "first_boxed")


def test_last_boxed_deep_nesting_is_linear():
    t = time.perf_counter()
    assert last_boxed(r"\boxed{" + DEEP_FRAC + "}") == DEEP_FRAC
    assert time.perf_counter() - t < 0.5


@pytest.mark.parametrize("answer, truth, score", [
    ("42", "42", 1.0), ("007", "7", 1.0), ("-0", "0", 1.0), ("+5", "5", 1.0), ("$42$", "42", 1.0),
    ("41", "42", 0.0), ("-42", "42", 0.0), ("1" * 5000, "1" * 5000, 1.0), ("1" * 5000, "1" * 4999 + "2", 0.0),
])
def test_integer_fast_path_never_starts_a_verifier(answer, truth, score):
    s = RewardScorer(timeout_s=TIMEOUT_S)
    r = s.score(ans(answer), truth)
    assert (r.score, r.reason) == (score, "correct" if score else "wrong")
    assert s._pool is None


def test_no_answer(scorer):
    r = scorer.score("<answer>I give up</answer>", "42")
    assert (r.score, r.answer, r.reason) == (0.0, None, "no_answer")


@pytest.mark.parametrize("answer, truth, score", [
    (r"\frac{84}{2}", "42", 1.0), (r"\frac{1}{2}", "0.5", 1.0), ("x^2+1", "1+x^2", 1.0),
    (r"\sqrt{2}/2", r"\frac{\sqrt{2}}{2}", 1.0), (r"\frac{1}{3}", "0.5", 0.0), ("42.5", "42", 0.0),
])
def test_math_verify_path(scorer, answer, truth, score):
    r = scorer.score(ans(answer), truth)
    assert r.score == score and r.reason == ("correct" if score else "wrong"), r


@pytest.mark.parametrize("answer", [POW_TOWER, DEEP_FRAC])
def test_pathological_answer_scores_zero_within_limit_and_pool_stays_healthy(scorer, answer):
    t = time.monotonic()
    results = scorer.score_batch([ans(answer), ans(r"\frac{6}{3}")], ["42", "2"])
    elapsed = time.monotonic() - t
    assert results[0].score == 0.0 and results[0].reason in {"timeout", "verifier_error", "verifier_crashed"}
    assert results[0].detail
    assert results[1].score == 1.0  # the other worker kept going
    # one time limit, plus a worker start-up when the pool was empty
    assert elapsed < TIMEOUT_S + 5.0  # slack for a loaded shared machine; unbounded would hang
    assert scorer.score(ans(r"\frac{10}{5}"), "2").score == 1.0  # the replacement worker serves


def test_worker_crash_is_scored_zero_with_reason():
    with VerifierPool(num_workers=1, timeout_s=30.0) as pool:
        assert pool.verify_many([("1", "1")]) == [("correct", "")]
        w = pool._ready[0]
        threading.Timer(0.5, w.proc.kill).start()  # dies while stuck on the tower
        t = time.monotonic()
        [(reason, detail)] = pool.verify_many([(POW_TOWER, "1")])
        assert reason == "verifier_crashed" and "-9" in detail
        assert time.monotonic() - t < 5
        assert pool.verify_many([(r"\frac{4}{2}", "2")]) == [("correct", "")]


def test_limit_is_cpu_time_so_a_starved_worker_is_not_failed_but_wall_time_is_capped():
    import signal

    from rstar_hpc.algo._verify_pool import WALL_FACTOR, _cpu_seconds

    assert 0 < _cpu_seconds(os.getpid()) < float("inf")
    with VerifierPool(num_workers=1, timeout_s=0.5) as pool:
        assert pool.verify_many([("1", "1")]) == [("correct", "")]
        pid = pool._ready[0].proc.pid
        os.kill(pid, signal.SIGSTOP)  # a node so busy the worker gets no CPU for 2x the limit
        threading.Timer(1.0, os.kill, (pid, signal.SIGCONT)).start()
        t = time.monotonic()
        assert pool.verify_many([(r"\frac{9}{3}", "3")]) == [("correct", "")]
        assert time.monotonic() - t > 1.0
        os.kill(pool._ready[0].proc.pid, signal.SIGSTOP)  # starved for good: the wall-clock cap ends it
        t = time.monotonic()
        [(reason, detail)] = pool.verify_many([("2", "2")])
        assert reason == "timeout" and "wall" in detail
        assert WALL_FACTOR * 0.5 <= time.monotonic() - t < WALL_FACTOR * 0.5 + 1.0


def test_batch_uses_all_cores_and_keeps_order(scorer):
    assert RewardScorer().num_workers == len(os.sched_getaffinity(0))
    answers = [rf"\frac{{{2 * k}}}{{2}}" for k in range(12)] + [str(k) for k in range(12)]
    truths = [str(k if k % 3 else k + 1) for k in range(12)] * 2
    results = scorer.score_batch([ans(a) for a in answers], truths)
    assert [r.score for r in results] == [float(k % 3 != 0) for k in range(12)] * 2
    assert len(scorer._pool._ready) == 2


def test_math_reward_convenience():
    assert math_reward(ans("12"), "12") == 1.0
    assert math_reward(r"\boxed{12}", "12") == 0.0  # the paper's rule wants <answer>
    assert math_reward(r"\boxed{12}", "12", answer_extraction="last_boxed") == 1.0
    assert score_response(ans("13"), "12").reason == "wrong"


def test_bad_input_says_what_to_fix():
    with pytest.raises(ValueError, match="one ground truth per response"):
        RewardScorer().score_batch(["a", "b"], ["1"])
    with pytest.raises(TypeError, match="valid names"):
        RewardScorer(timeout=3)
    with pytest.raises(pydantic.ValidationError, match="timeout_s"):
        RewardScorer(timeout_s=-1)


def test_public_api_resolves_and_reward_never_loads_torch():
    import subprocess
    import sys

    import rstar_hpc.algo as algo

    for name in algo.__all__:
        assert getattr(algo, name) is not None
    code = "import sys, rstar_hpc.algo.reward; assert 'torch' not in sys.modules, 'reward imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
