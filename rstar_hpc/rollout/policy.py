"""Where a trajectory runs: the admission policies shared by the MPI scheduler and bench/rollout_balance.py.

`KVAwarePolicy` is rStar2-Agent's (reference §4.3): each engine has an admission capacity of
kv_tokens / budget_coef; a trajectory reserves its worst case (prompt + max response) for its whole life,
goes to the engine with the most unreserved capacity that fits it, and stays there for all its turns
(prefix-cache reuse); when nothing fits it waits, and it is admitted the moment a release frees room.
`StaticPolicy` is the usual baseline: trajectories split round-robin over engines up front, each engine
takes its whole share at once and lets its own scheduler (vLLM's: FCFS, preempt-and-recompute) cope.

Both are plain bookkeeping over engine ids (no MPI, no vLLM), so the simulation and the real scheduler
decide identically.
"""
from __future__ import annotations

from typing import Hashable, Iterable


class KVAwarePolicy:
    name = "kv_aware"

    def __init__(self, capacities: dict[int, int], *, budget_coef: float = 1.0, max_per_engine: int = 256):
        if not capacities:
            raise ValueError("KV-aware admission needs at least one engine")
        self.capacity = {e: int(c / budget_coef) for e, c in capacities.items()}
        self.free = dict(self.capacity)
        self.count = {e: 0 for e in capacities}
        self.max_per_engine = max_per_engine
        self.placed: dict[Hashable, tuple[int, int]] = {}

    def check_fits_somewhere(self, budget: int) -> None:
        """A budget no engine could ever hold would wait forever: refuse it up front."""
        if budget > max(self.capacity.values()):
            raise ValueError(f"a trajectory's worst case of {budget} tokens (prompt + max response) exceeds every "
                             f"engine's admission capacity (max {max(self.capacity.values())} tokens); raise the "
                             f"KV cache (rollout.engine.kv_cache_memory_mb / gpu_memory_utilization), lower "
                             f"rollout.scheduler.budget_coef, or shorten rollout.agent.max_response_length")

    def place(self, key: Hashable, budget: int) -> int | None:
        """The engine `key` is admitted to (capacity reserved), or None: wait for a release."""
        best = None
        for e, free in self.free.items():
            if free >= budget and self.count[e] < self.max_per_engine and (best is None or free > self.free[best]):
                best = e
        if best is not None:
            self.free[best] -= budget
            self.count[best] += 1
            self.placed[key] = (best, budget)
        return best

    def release(self, key: Hashable) -> None:
        e, budget = self.placed.pop(key)
        if e in self.free:
            self.free[e] += budget
            self.count[e] -= 1

    def engine_lost(self, engine: int) -> list[Hashable]:
        """Forget a dead engine; returns the keys that were on it (the caller re-queues them)."""
        self.free.pop(engine, None)
        self.count.pop(engine, None)
        self.capacity.pop(engine, None)
        lost = [k for k, (e, _) in self.placed.items() if e == engine]
        for k in lost:
            del self.placed[k]
        return lost

    @property
    def engines(self) -> list[int]:
        return list(self.free)


class StaticPolicy:
    name = "static"

    def __init__(self, engines: Iterable[int]):
        self._engines = list(engines)
        if not self._engines:
            raise ValueError("static split needs at least one engine")
        self._next = 0
        self.placed: dict[Hashable, int] = {}

    def check_fits_somewhere(self, budget: int) -> None:
        pass   # the engine's own scheduler queues and preempts

    def place(self, key: Hashable, budget: int) -> int:
        e = self._engines[self._next % len(self._engines)]
        self._next += 1
        self.placed[key] = e
        return e

    def release(self, key: Hashable) -> None:
        self.placed.pop(key, None)

    def engine_lost(self, engine: int) -> list[Hashable]:
        self._engines = [e for e in self._engines if e != engine]
        lost = [k for k, e in self.placed.items() if e == engine]
        for k in lost:
            del self.placed[k]
        return lost

    @property
    def engines(self) -> list[int]:
        return list(self._engines)


def make_policy(name: str, capacities: dict[int, int], *, budget_coef: float = 1.0, max_per_engine: int = 256):
    if name == "kv_aware":
        return KVAwarePolicy(capacities, budget_coef=budget_coef, max_per_engine=max_per_engine)
    if name == "static":
        return StaticPolicy(sorted(capacities))
    raise ValueError(f"rollout.scheduler.policy={name!r}: use 'kv_aware' or 'static'")
