"""Quality penalties of a trajectory for Resample-on-Correct (paper §2.2.3, Eq. 4-5).

    p_err    = failed tool calls / tool calls,  or 0.5 with no tool call (the paper's default, which
               nudges the policy towards using the tool)
    p_format = 1                                     if there is no closed <answer>...</answer>
               min(1, (num_answers - 1) / num_turns) otherwise

Decisions (against microsoft/rStar rstar2_agent/down_sample/ and the paper §2.2.3):
- A call "failed" when its structured sandbox status is in FAILED_TOOL_STATUSES, not when its text contains
  "error" as in the public code (which counts a successful program printing "error", and misses a timeout
  whose text lacks the word). `output_truncated` ran fine and only lost output, so it is not a failure;
  `parse_error` (the call's JSON did not parse; the agent loop reports it) is, as in the paper. Infrastructure
  failures (INFRA_TOOL_STATUSES) say nothing about the code and are left out of p_err altogether. An unknown
  status raises, so a new sandbox status cannot be silently counted as a success.
- num_turns is the number of assistant turns (generation calls) of the trajectory. The public code counts
  only the assistant blocks that start inside the response, so it never counts the first turn: a clean
  answer without tool calls gets p_format 1 and a penalty of 1.5. `count_first_turn=True` (default) counts
  it, the paper's evident intent; False reproduces the code (and then 0 turns gives p_format 1).
- Answers are counted outside <tool_response> blocks. Unbalanced tags (an <answer> never closed, or a
  stray </answer>) give p_format 1, as in the public code.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from rstar_hpc.algo._config import resolve
from rstar_hpc.config.algo import RoCConfig
from rstar_hpc.exchange import tool_status
from rstar_hpc.exchange.tool_status import FAILED_TOOL_STATUSES, INFRA_TOOL_STATUSES

TOOL_STATUSES = frozenset(tool_status.TOOL_STATUSES)
"""Every status a tool call can carry (the exchange's list): the sandbox's nine, plus `parse_error` from the
agent loop. FAILED_TOOL_STATUSES and INFRA_TOOL_STATUSES are defined beside it, in rstar_hpc.exchange.tool_status."""
NO_TOOL_P_ERR = 0.5

_TOOL_RESPONSE = re.compile(r"<tool_response>.*?(?:</tool_response>|\Z)", re.S)


@dataclass(frozen=True, slots=True)
class Quality:
    num_tool_calls: int
    """Calls with a verdict on the code (infrastructure failures left out)."""
    num_failed_calls: int
    num_turns: int
    """Turns counted for p_format (after `count_first_turn`)."""
    num_answers: int
    """Closed <answer>...</answer> blocks."""
    p_err: float
    p_format: float


def _tool_counts(statuses: Iterable[str]) -> tuple[int, int, float]:
    """(calls with a verdict on the code, failed ones, p_err). Calls lost to the sandbox's infrastructure are
    left out; a trajectory whose every call was lost made calls, so its p_err is 0, not the no-call 0.5."""
    made = n = failed = 0
    for s in statuses:
        if s not in TOOL_STATUSES:
            raise ValueError(f"unknown tool status {s!r}; expected one of {sorted(TOOL_STATUSES)} "
                             "(add it to rstar_hpc.exchange.tool_status.TOOL_STATUSES, and to its "
                             "FAILED_TOOL_STATUSES if it is a failure)")
        made += 1
        if s in INFRA_TOOL_STATUSES:
            continue
        n += 1
        failed += s in FAILED_TOOL_STATUSES
    err = failed / n if n else (0.0 if made else NO_TOOL_P_ERR)
    return n, failed, err


def p_err(tool_statuses: Iterable[str]) -> float:
    """Failed calls / calls, 0.5 with none (Eq. 4); infrastructure failures are left out (`_tool_counts`)."""
    return _tool_counts(tool_statuses)[2]


def _answers(response: str) -> tuple[int, bool]:
    text = _TOOL_RESPONSE.sub("", response)
    opens, closes = text.count("<answer>"), text.count("</answer>")
    pairs = len(re.findall(r"<answer>.*?</answer>", text, re.S))
    return pairs, opens == closes == pairs


def p_format(response: str, num_turns: int, *, count_first_turn: bool = True) -> float:
    """Eq. 5 with `num_turns` assistant turns (see the module docstring for the turn count)."""
    return _p_format(response, num_turns, count_first_turn)[0]


def _p_format(response: str, num_turns: int, count_first_turn: bool) -> tuple[float, int, int]:
    if num_turns < 1:
        raise ValueError(f"num_turns must be >= 1 (the number of assistant turns, the first included), "
                         f"got {num_turns}")
    turns = num_turns if count_first_turn else num_turns - 1
    pairs, balanced = _answers(response)
    if pairs == 0 or not balanced or turns == 0:
        return 1.0, turns, pairs
    return min(1.0, (pairs - 1) / turns), turns, pairs


def trajectory_quality(response: str, tool_statuses: Iterable[str], num_turns: int,
                       cfg: RoCConfig | None = None, **kwargs) -> Quality:
    """p_err and p_format of one trajectory. `response` is the response text (tool responses may be left in;
    they are skipped), `tool_statuses` one status per tool call, `num_turns` the assistant turns."""
    cfg = resolve(RoCConfig, cfg, kwargs)
    n, failed, err = _tool_counts(tool_statuses)
    fmt, turns, pairs = _p_format(response, num_turns, cfg.count_first_turn)
    return Quality(n, failed, turns, pairs, err, fmt)
