"""Prompt files (rl, hard_subset, eval): [{"uid", "question", "answer"}] out of the layouts users already have.

Layouts, detected per row from its columns:
  verl      `prompt` is a list of chat messages (microsoft/rStar's data_preprocess, verl's examples, the original
            DAPO-Math-17k): the question is the one user turn; a system turn is dropped unless `keep_system`
            (then the row carries it as "system"); the ground truth is `reward_model.ground_truth`; the problem id
            is `extra_info.index` when there is one. `data_source`, `ability` and the rest are ignored.
  flat      a question column (question, problem, or `prompt` as a string: DAPO's flat copies) and an answer
            column (answer, ground_truth, solution; `reward_model.ground_truth` first when present); a `system`
            column (text; a hard_subset stage's output carries the turns it kept) is a system turn, dropped unless
            `keep_system` like a verl one.
The answer cell then goes through data.answers: GSM8K's `#### n`, the last \\boxed{} of a MATH solution, or the
text as given; a cell that is a rationale with no final answer refuses the file, naming the column. The format
reported is "verl", "gsm8k", "math-solution" or "question-answer" (the most common among the rows).

A question that starts with the rStar2 instruction the prompt renderer adds (chat_format.USER_PREFIX) is stored
without it, so it is not shown twice. Exact repeats of a (question, answer) pair (the original DAPO-Math-17k has
each prompt ~100 times) are dropped and counted. `uid` or `id` names a prompt, else `extra_info.index`, else a hash
of its question; two different prompts with one uid are an error.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from rstar_hpc.data.answers import BOXED, HASHES, ground_truth, prose_words
from rstar_hpc.data.files import DatasetError, Rows, content_text, maybe_json, read_rows
from rstar_hpc.models.chat_format import USER_PREFIX

QUESTION_KEYS = ("question", "problem", "prompt")
ANSWER_KEYS = ("answer", "ground_truth", "solution")
VERL_ANSWER = "reward_model.ground_truth"
REPEATS = "repeated question and answer"
SYSTEM_UNUSED = "system turns dropped (keep_system is off)"
SYSTEM_KEPT = "system turns kept"


@dataclass
class PromptSet:
    """What a prompt file holds, and how it was read (for `rstar-hpc data show`)."""

    rows: list[dict]
    format: str
    read: int
    """Rows in the file."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Reason -> rows left out."""
    sources: dict[str, int] = field(default_factory=dict)
    """"question <- X, answer <- Y (rule)" -> rows read that way."""
    notes: dict[str, int] = field(default_factory=dict)


def _scalar(v) -> str | None:
    if isinstance(v, (list, tuple)) and len(v) == 1:
        v = v[0]
    if isinstance(v, (str, int, float)) and not isinstance(v, bool) and str(v).strip():
        return str(v)
    return None


def _from_messages(msgs: list, where: str) -> tuple[str, str | None]:
    """(question, system text or None) of a verl `prompt`: one user turn, optionally after a system turn."""
    roles = [m.get("role") if isinstance(m, dict) else type(m).__name__ for m in msgs]
    users = [m for m in msgs if isinstance(m, dict) and m.get("role") == "user"]
    systems = [m for m in msgs if isinstance(m, dict) and m.get("role") == "system"]
    if len(users) != 1 or len(systems) + 1 != len(msgs) or len(systems) > 1:
        raise DatasetError(f"{where}: column 'prompt' holds the turns {roles}; a prompt is one user turn (optionally "
                           f"after one system turn): few-shot or multi-turn prompts are not supported, put the "
                           f"question in one user turn")
    question = content_text(users[0].get("content"), f"{where}, prompt's user turn")
    system = content_text(systems[0].get("content"), f"{where}, prompt's system turn") if systems else None
    return question, system


def _question(row: dict, where: str) -> tuple[str, str, str | None]:
    """(question, where it came from, system turn or None)."""
    prompt = maybe_json(row.get("prompt"))
    if isinstance(prompt, list):
        question, system = _from_messages(prompt, where)
        if not question.strip():
            raise DatasetError(f"{where}: the user turn of column 'prompt' is empty; it must hold the question")
        return question, "prompt (user turn)", system
    for k in QUESTION_KEYS:
        v = _scalar(row.get(k))
        if v is not None:
            system = row.get("system")
            return v, k, system if isinstance(system, str) and system.strip() else None
    raise DatasetError(f"{where}: no question (looked for {', '.join(QUESTION_KEYS)}, or a verl 'prompt' list of "
                       f"chat messages; the row has {sorted(row)})")


def _answer(row: dict, where: str) -> tuple[str, str, str]:
    """(ground truth, the column it came from, the rule that gave it)."""
    reward_model = maybe_json(row.get("reward_model"))
    candidates = [(VERL_ANSWER, reward_model.get("ground_truth"))] if isinstance(reward_model, dict) else []
    candidates += [(k, row.get(k)) for k in ANSWER_KEYS]
    for column, value in candidates:
        if isinstance(value, (list, tuple)) and len(value) > 1:
            raise DatasetError(f"{where}: column {column!r} holds {len(value)} answers; a ground truth is one answer "
                               f"(keep one, or write one row per answer)")
        text = _scalar(value)
        if text is None:
            continue
        found = ground_truth(text)
        if found is None:
            raise DatasetError(
                f"{where}: column {column!r} holds a worked solution ({prose_words(text)} words of prose), not a final "
                f"answer, and no rule finds one in it (no '#### <answer>' last line, no \\boxed{{}}). The reward "
                f"compares the model's \\boxed{{}} answer with the ground truth, so a whole solution would score ~0: "
                f"give the file a short-answer column (answer or ground_truth), or end each solution with "
                f"\\boxed{{<answer>}} or a '#### <answer>' line")
        return found[0], column, found[1]
    raise DatasetError(f"{where}: no answer (looked for {', '.join(ANSWER_KEYS)} and {VERL_ANSWER}; the row has "
                       f"{sorted(row)})")


def _uid(row: dict, question: str) -> str:
    extra = maybe_json(row.get("extra_info"))
    for v in (row.get("uid"), row.get("id"), extra.get("index") if isinstance(extra, dict) else None):
        if v is not None and str(v).strip():
            return str(v)
    return hashlib.sha1(question.encode()).hexdigest()[:16]


def _layout(question_from: str, answer_from: str, rule: str) -> str:
    if question_from.startswith("prompt ("):
        return "verl"
    if rule == HASHES:
        return "gsm8k"
    if rule == BOXED and answer_from == "solution":
        return "math-solution"
    return "question-answer"


def read_prompt_file(path: str | Path | Rows, *, keep_system: bool = False, missing_hint: str = "") -> PromptSet:
    """The prompts of a JSONL or Parquet file; DatasetError naming the file, the row and the fix if one is bad."""
    src = path if isinstance(path, Rows) else read_rows(path, missing_hint)
    out, seen, uids = [], set(), set()
    dropped, sources, layouts, notes = Counter(), Counter(), Counter(), Counter()
    for i, row in enumerate(src.rows):
        where = f"{src.path} row {i + 1}"
        question, question_from, system = _question(row, where)
        if question.startswith(USER_PREFIX):
            question = question[len(USER_PREFIX):]
        answer, answer_from, rule = _answer(row, where)
        if system is not None:
            notes[SYSTEM_KEPT if keep_system else SYSTEM_UNUSED] += 1
            system = system if keep_system else None
        key = (system, question, answer)
        if key in seen:
            dropped[REPEATS] += 1
            continue
        seen.add(key)
        uid = _uid(row, question)
        if uid in uids:
            raise DatasetError(f"{where}: prompt uid {uid!r} appears twice; uids name a GRPO group and must be "
                               f"unique (drop the duplicate or give it another uid)")
        uids.add(uid)
        sources[f"question <- {question_from}, answer <- {answer_from} ({rule})"] += 1
        layouts[_layout(question_from, answer_from, rule)] += 1
        out.append({"uid": uid, "question": question, "answer": answer, **({"system": system} if system else {})})
    if not out:
        raise DatasetError(f"{src.path}: no prompts; a benchmark or prompt file needs rows with a question and an "
                           f"answer ({', '.join(QUESTION_KEYS)} / {', '.join(ANSWER_KEYS)}, or the verl schema)")
    return PromptSet(out, layouts.most_common(1)[0][0], len(src.rows), dict(dropped), dict(sources), dict(notes))
