"""Outcome reward: r = 1 if the final answer is equivalent to the ground truth, else 0 (paper §2.2.1, Eq. 3).

Extraction (`RewardConfig.answer_extraction`):
  answer_tag  the last \\boxed{} (or \\fbox{}) inside a closed <answer>...</answer> block, the paper's rule.
              A truncated trace whose <answer> never closes has no answer and scores 0 (paper §4.3.1).
  last_boxed  the last \\boxed{} anywhere, the public code's looser rule (microsoft/rStar's math reward).
In both modes <tool_response> blocks are removed first: a program that prints `\\boxed{42}` is not the
model's answer (the public code scans tool output too).

Verification: if answer and ground truth are both plain integers (the paper's RL data is integer-only, §4.2)
they are compared in-process as digit strings (any length, `007` == `7`, `-0` == `0`). Anything else goes to
math-verify with the ground truth wrapped as \\boxed{gt} (as the public code does), in killable worker
processes (`_verify_pool`) under a hard limit of `RewardConfig.timeout_s` per answer; a timeout, a crash or a
verifier exception scores 0 and says so in `RewardResult.reason`. The public code's first grader (PRIME's
string/sympy grader) is not used: math-verify alone covers it on integer and LaTeX answers.
"""
from __future__ import annotations

import atexit
import os
import re
from dataclasses import dataclass
from typing import Literal, Sequence

from rstar_hpc.algo._config import resolve
from rstar_hpc.algo._verify_pool import VerifierPool
from rstar_hpc.config.algo import RewardConfig

Reason = Literal["correct", "wrong", "no_answer", "timeout", "verifier_error", "verifier_crashed"]


@dataclass(frozen=True, slots=True)
class RewardResult:
    score: float
    """1.0 or 0.0."""
    answer: str | None
    """The extracted answer, None when there is none."""
    reason: Reason
    detail: str = ""
    """Why verification failed (exception text, time limit), empty otherwise."""


_TOOL_RESPONSE = re.compile(r"<tool_response>.*?(?:</tool_response>|\Z)", re.S)
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.S)
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")
_INT = re.compile(r"([+-]?)0*(\d+)")


def last_boxed(text: str) -> str | None:
    """Content of the last balanced \\boxed{...} or \\fbox{...} in `text`, or None."""
    for m in reversed(list(_BOX.finditer(text))):
        depth = 1
        for b in _BRACE.finditer(text, m.end()):
            depth += 1 if b.group() == "{" else -1
            if depth == 0:
                return text[m.end():b.start()].strip()
    return None


def extract_answer(response: str, answer_extraction: str = "answer_tag") -> str | None:
    """The final answer of `response` under the given extraction rule (see the module docstring)."""
    text = _TOOL_RESPONSE.sub("", response)
    if answer_extraction == "last_boxed":
        return last_boxed(text)
    if answer_extraction != "answer_tag":
        raise ValueError(f"answer_extraction must be 'answer_tag' or 'last_boxed', got {answer_extraction!r}")
    for block in reversed(_ANSWER_BLOCK.findall(text)):
        if (ans := last_boxed(block)) is not None:
            return ans
    return None


def _as_int(s: str) -> str | None:
    m = _INT.fullmatch(s.strip().strip("$").strip())
    if m is None:
        return None
    sign, digits = m.groups()
    return digits if sign != "-" or digits == "0" else "-" + digits


def _fast(answer: str | None, ground_truth: str) -> RewardResult | None:
    if answer is None:
        return RewardResult(0.0, None, "no_answer")
    a, g = _as_int(answer), _as_int(ground_truth)
    if a is None or g is None:
        return None
    return RewardResult(1.0, answer, "correct") if a == g else RewardResult(0.0, answer, "wrong")


class RewardScorer:
    """Scores responses against ground truths. Integers are compared in-process; other answers go to a pool
    of `num_workers` verifier processes (0: one per core this process may use), started on first need.

    >>> with RewardScorer(timeout_s=2.0) as scorer:
    ...     results = scorer.score_batch(responses, ground_truths)
    """

    def __init__(self, cfg: RewardConfig | None = None, **kwargs):
        self.cfg = resolve(RewardConfig, cfg, kwargs)
        self._pool: VerifierPool | None = None

    @property
    def num_workers(self) -> int:
        return self.cfg.num_workers or len(os.sched_getaffinity(0))

    def score(self, response: str, ground_truth: str) -> RewardResult:
        return self.score_batch([response], [ground_truth])[0]

    def score_batch(self, responses: Sequence[str], ground_truths: Sequence[str]) -> list[RewardResult]:
        if len(responses) != len(ground_truths):
            raise ValueError(f"got {len(responses)} responses but {len(ground_truths)} ground truths; "
                             "pass one ground truth per response (repeat a prompt's answer for each rollout)")
        answers = [extract_answer(r, self.cfg.answer_extraction) for r in responses]
        results = [_fast(a, str(g)) for a, g in zip(answers, ground_truths, strict=True)]
        hard = [i for i, r in enumerate(results) if r is None]
        if hard:
            if self._pool is None:
                self._pool = VerifierPool(self.num_workers, self.cfg.timeout_s)
            verdicts = self._pool.verify_many([(answers[i], str(ground_truths[i])) for i in hard])
            for i, (reason, detail) in zip(hard, verdicts, strict=True):
                results[i] = RewardResult(float(reason == "correct"), answers[i], reason, detail)  # type: ignore[arg-type]
        return results  # type: ignore[return-value]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_shared: dict[str, RewardScorer] = {}  # one scorer per config for the one-response helpers below


@atexit.register
def _close_shared() -> None:
    for s in _shared.values():
        s.close()


def _scorer(cfg: RewardConfig | None, kwargs: dict) -> RewardScorer:
    resolved = resolve(RewardConfig, cfg, kwargs)
    key = resolved.model_dump_json()
    if key not in _shared:
        _shared[key] = RewardScorer(resolved)
    return _shared[key]


def score_response(response: str, ground_truth: str, cfg: RewardConfig | None = None, **kwargs) -> RewardResult:
    """Score one response with the extracted answer and the reason (a process-wide scorer per config)."""
    return _scorer(cfg, kwargs).score(response, ground_truth)


def math_reward(response: str, ground_truth: str, cfg: RewardConfig | None = None, **kwargs) -> float:
    """1.0 if the response's final answer equals `ground_truth`, else 0.0. For many responses use
    `RewardScorer.score_batch`, which verifies them in parallel."""
    return score_response(response, ground_truth, cfg, **kwargs).score
