"""The ground truth of an answer cell. The reward compares the model's \\boxed{} answer with it, so it must be the
short final answer, never a worked solution (a rationale as ground truth scores ~0 with nothing saying why).

Rules, in order, on the cell's text:
  1. GSM8K: the last line is `#### n` -> n. A number written with thousands separators (`1,234`) loses them
     (`1234`): the reward then compares it as an integer; GSM8K's own answers have none.
  2. A `\\boxed{...}` or `\\fbox{...}` anywhere -> the content of the last one, braces balanced (the MATH
     `solution` column, or a ground truth stored boxed); the reward's own extraction (algo.reward.last_boxed).
  3. Otherwise the text as given, unless it is clearly a rationale: RATIONALE_WORDS or more words of prose (runs
     of two or more letters that are not LaTeX commands). Then there is no final answer to take and the file is
     refused. The rule is deliberately loose: a long LaTeX expression, a tuple or a short phrase is an answer.
"""
from __future__ import annotations

import re

RATIONALE_WORDS = 12
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")
_GROUPED = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")

AS_GIVEN, HASHES, BOXED = "as given", "#### n", "last \\boxed{}"


def prose_words(text: str) -> int:
    return len(_WORD.findall(text))


def is_rationale(text: str) -> bool:
    """Clearly a worked solution rather than an answer: RATIONALE_WORDS or more words of prose."""
    return prose_words(text) >= RATIONALE_WORDS


def ground_truth(text: str) -> tuple[str, str] | None:
    """(ground truth, the rule that gave it), or None when the text is a rationale with no final answer in it."""
    from rstar_hpc.algo.reward import last_boxed

    text = text.strip()
    last = text.splitlines()[-1].strip() if text else ""
    if last.startswith("####") and last[4:].strip():
        answer = last[4:].strip()
        return (answer.replace(",", "") if _GROUPED.fullmatch(answer) else answer), HASHES
    boxed = last_boxed(text)
    if boxed:
        return boxed, BOXED
    if is_rationale(text):
        return None
    return text, AS_GIVEN
