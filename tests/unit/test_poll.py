"""exchange/poll.py: the waits on shared storage look again after a tenth of the time waited, within bounds."""
from __future__ import annotations

import time

import pytest

from rstar_hpc.exchange.poll import Backoff, expected_lateness_s


def test_the_interval_is_a_tenth_of_the_wait_within_its_bounds(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    b = Backoff(max_s=1.0, min_s=0.1)
    assert b.interval() == pytest.approx(0.1)       # at once: the floor
    now[0] += 3.0
    assert b.interval() == pytest.approx(0.3)       # a 3 s wait (a tiny run's step) is seen within 0.3 s
    now[0] += 600.0
    assert b.interval() == pytest.approx(1.0)       # a long wait costs one look a second, as a fixed poll did


def test_sleep_keeps_within_a_deadline(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    b = Backoff(max_s=5.0, min_s=0.5)
    b.sleep(cap_s=0.1)
    b.sleep()
    assert slept[0] == pytest.approx(0.1) and slept[1] == pytest.approx(0.5, abs=0.01)


def test_a_long_wait_looks_about_as_often_as_a_fixed_one_second_poll():
    b, t, looks = Backoff(max_s=1.0), 0.0, 0
    while t < 600.0:   # ten minutes
        t += min(b.max_s, max(b.min_s, b.fraction * t))
        looks += 1
    assert 600 <= looks <= 650, looks


def test_a_hand_off_is_seen_half_an_interval_late():
    assert expected_lateness_s(0.5) == pytest.approx(0.05)      # a tiny run's wait: at the floor
    assert expected_lateness_s(4.0) == pytest.approx(0.2)
    assert expected_lateness_s(900.0) == pytest.approx(0.5)     # a 14B step's wait: half the 1 s ceiling
    assert expected_lateness_s(900.0, max_s=5.0) == pytest.approx(2.5)
    assert expected_lateness_s(-1.0) == pytest.approx(0.05)     # no wait: the first look's floor
