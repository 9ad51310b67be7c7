"""Rank 0's stage progress: a problem counts once all its samples are in; without a terminal, log lines."""
from __future__ import annotations

import logging

from rstar_hpc.rollout.progress import StageProgress
from rstar_hpc.rollout.step import WorkItem


def _items(uids: list[str], k: int) -> list[WorkItem]:
    return [WorkItem(u, s, [1, 2], "p", "1") for u in uids for s in range(k)]


def test_problems_done_tokens_and_eta_in_log_lines(caplog):
    p = StageProgress("eval", total=5, done=1, every_s=0.0, tty=False)   # one problem committed earlier
    p.start_step(_items(["b/1", "b/2"], k=2))
    with caplog.at_level(logging.INFO, logger="rstar_hpc.rollout"):
        p([("b/1", 0)], 10)
        assert p.done == 1   # half of b/1's samples
        p([("b/1", 1)], 30)
        assert p.done == 2
        p([("b/2", 0), ("b/2", 1)], 0)   # e.g. kept from the step's journal
    assert p.done == 3 and p.tokens == 40
    last = caplog.records[-1].getMessage()
    assert last.startswith("rollout eval: 3/5 problems,") and "tok/s" in last and "ETA" in last and "?" not in last
    p.start_step(_items(["c/1"], k=2))   # the next step: its own problems
    p([("c/1", 0), ("c/1", 1)], 5)
    assert p.done == 4
    p.close()


def test_no_log_line_more_often_than_every_s(caplog):
    p = StageProgress("rl", total=2, every_s=3600.0, tty=False)
    p.start_step(_items(["a", "b"], k=1))
    with caplog.at_level(logging.INFO, logger="rstar_hpc.rollout"):
        p([("a", 0)], 1)
        assert not caplog.records
        p([("b", 0)], 1)   # the last problem: always said
    assert [r.getMessage().split(",")[0] for r in caplog.records] == ["rollout rl: 2/2 problems"]
