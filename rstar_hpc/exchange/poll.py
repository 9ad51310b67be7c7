"""How often a role looks at shared storage while it waits for another role (a committed step, a published policy).

    wait = Backoff(max_s=1.0)
    while not ready():
        wait.sleep()

The interval is a tenth of the time waited so far, between `min_s` and `max_s`: a wait that ends within seconds
(a tiny run's step, where a fixed 1 s poll cost the trainer and the rollout ~0.7 s a step each) is seen within a
tenth of its length, and a wait of minutes (a 14B step on a cluster) costs one look every `max_s` after its first
10 s, as a fixed poll did: ~40 looks more in those seconds, nothing a Lustre metadata server notices.
"""
from __future__ import annotations

import time


def interval_after(waited_s: float, max_s: float = 1.0, min_s: float = 0.1, fraction: float = 0.1) -> float:
    """The interval a Backoff polls at after `waited_s` seconds of waiting."""
    return min(max_s, max(min(min_s, max_s), fraction * max(0.0, waited_s)))


class Backoff:
    def __init__(self, max_s: float = 1.0, min_s: float = 0.1, fraction: float = 0.1):
        self.max_s, self.min_s, self.fraction = max_s, min_s, fraction
        self.t0 = time.monotonic()

    def interval(self) -> float:
        return interval_after(time.monotonic() - self.t0, self.max_s, self.min_s, self.fraction)

    def sleep(self, cap_s: float | None = None) -> None:
        """Sleep one interval (at most `cap_s`: a deadline's remainder)."""
        s = self.interval()
        time.sleep(max(0.0, min(s, cap_s)) if cap_s is not None else s)


def expected_lateness_s(wait_s: float, max_s: float = 1.0, min_s: float = 0.1, fraction: float = 0.1) -> float:
    """How long after a wait of `wait_s` ends a Backoff poller sees it, on average: half the interval it polls at
    by then (the planner's hand-off between the roles)."""
    return interval_after(wait_s, max_s, min_s, fraction) / 2
