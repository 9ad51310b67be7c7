"""What a pool counts: calls by status, a latency histogram and quantiles, restarts, evictions, session states."""
from __future__ import annotations

import collections

from sandbox.results import STATUSES

LATENCY_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 60000)


class Stats:
    def __init__(self) -> None:
        self.by_status = dict.fromkeys(STATUSES, 0)
        self.hist = [0] * (len(LATENCY_BUCKETS_MS) + 1)
        self.recent: collections.deque[float] = collections.deque(maxlen=10000)
        self.calls = 0
        self.restarts = collections.Counter()
        self.evictions = collections.Counter()
        self.sessions = collections.Counter()   # by state reported
        self.released = 0                        # sessions their callers ended (op "release")

    def record(self, result: dict, latency_s: float) -> None:
        self.calls += 1
        self.by_status[result["status"]] = self.by_status.get(result["status"], 0) + 1
        ms = latency_s * 1000
        i = next((k for k, b in enumerate(LATENCY_BUCKETS_MS) if ms <= b), len(LATENCY_BUCKETS_MS))
        self.hist[i] += 1
        self.recent.append(latency_s)
        if result.get("session"):
            self.sessions[result["session"]["state"]] += 1

    def quantile(self, q: float) -> float | None:
        if not self.recent:
            return None
        xs = sorted(self.recent)
        return xs[min(len(xs) - 1, int(q * len(xs)))]
