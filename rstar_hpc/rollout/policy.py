"""Where a trajectory runs: the admission policies shared by the MPI scheduler and bench/rollout_balance.py.

`KVAwarePolicy` follows rStar2-Agent (reference §4.3): a trajectory goes to the engine with the most free
KV room, only if its reservation fits, stays there for all its turns (prefix-cache reuse), waits while
nothing fits, and is admitted the moment a release frees room. What it reserves is the difference:

    reservation(k) = min(context_k + growth, prompt_k + max_response)

context_k is the trajectory's current length as its engine rank last reported it (prompt at admission;
tool tokens included), growth = growth_reserve x max_response. growth_reserve=1 is the paper's worst case
(prompt + max response, held for the whole life): safe, but most budgets are never used, so engines run
small batches while decode pays a fixed cost per step. A smaller growth_reserve books what trajectories
hold NOW plus headroom and re-books as they grow; a rare overflow costs vLLM a preempt-and-recompute,
never a trajectory. An engine's room is kv_tokens / budget_coef (rStar2's `server_budget_coef`).

`StaticPolicy` is the usual baseline: trajectories split round-robin over engines up front, each engine
takes its whole share at once and lets its own scheduler (vLLM's: FCFS, preempt-and-recompute) cope.

Both are plain bookkeeping over engine ids (no MPI, no vLLM), so the simulation and the real scheduler
decide identically from the same information: prompt lengths, engine capacities, results, and the
per-trajectory context lengths engine ranks report in their heartbeats.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping


class KVAwarePolicy:
    name = "kv_aware"

    def __init__(self, capacities: Mapping[int, int], *, max_response: int, growth_reserve: float = 1.0,
                 budget_coef: float = 1.0, max_per_engine: int = 256):
        if not capacities:
            raise ValueError("KV-aware admission needs at least one engine")
        if not 0 < growth_reserve <= 1:
            raise ValueError(f"growth_reserve must be in (0, 1], got {growth_reserve}")
        self.capacity = {e: int(c / budget_coef) for e, c in capacities.items()}
        self.growth = max(1, int(growth_reserve * max_response))
        self.max_response = max_response
        self.max_per_engine = max_per_engine
        self.booked = {e: 0 for e in capacities}     # sum of the reservations of the engine's trajectories
        self.count = {e: 0 for e in capacities}
        # key -> [engine, prompt tokens, reported context tokens, current reservation]
        self.placed: dict[Hashable, list] = {}

    def _reservation(self, prompt: int, context: int) -> int:
        return min(context + self.growth, prompt + self.max_response)

    @property
    def free(self) -> dict[int, int]:
        return {e: self.capacity[e] - self.booked[e] for e in self.capacity}

    def check_fits_somewhere(self, prompt: int) -> None:
        """A trajectory no engine could ever hold would wait forever: refuse it up front."""
        need = self._reservation(prompt, prompt)
        if need > max(self.capacity.values()):
            raise ValueError(f"a trajectory's reservation of {need} tokens (prompt {prompt} + growth) exceeds every "
                             f"engine's admission capacity (max {max(self.capacity.values())} tokens); raise the "
                             f"KV cache (rollout.engine.kv_cache_memory_mb / gpu_memory_utilization), lower "
                             f"rollout.scheduler.growth_reserve or budget_coef, or shorten "
                             f"rollout.agent.max_response_length")

    def place(self, key: Hashable, prompt: int) -> int | None:
        """The engine `key` is admitted to (room booked), or None: wait for a release."""
        need = self._reservation(prompt, prompt)
        best, best_free = None, -1
        for e, cap in self.capacity.items():
            free = cap - self.booked[e]
            if free >= need and free > best_free and self.count[e] < self.max_per_engine:
                best, best_free = e, free
        if best is not None:
            self.booked[best] += need
            self.count[best] += 1
            self.placed[key] = [best, prompt, prompt, need]
        return best

    def observe(self, engine: int, contexts: Mapping[Hashable, int]) -> None:
        """An engine rank's report of its live trajectories' context lengths: re-book each one."""
        for key, ctx in contexts.items():
            p = self.placed.get(key)
            if p is None or p[0] != engine:
                continue   # finished or re-queued since the report was sent
            need = self._reservation(p[1], max(ctx, p[2]))
            self.booked[engine] += need - p[3]
            p[2], p[3] = max(ctx, p[2]), need

    def release(self, key: Hashable) -> None:
        e, _, _, need = self.placed.pop(key)
        if e in self.booked:
            self.booked[e] -= need
            self.count[e] -= 1

    def engine_lost(self, engine: int) -> list[Hashable]:
        """Forget a dead engine; returns the keys that were on it (the caller re-queues them)."""
        for d in (self.booked, self.count, self.capacity):
            d.pop(engine, None)
        lost = [k for k, p in self.placed.items() if p[0] == engine]
        for k in lost:
            del self.placed[k]
        return lost

    @property
    def engines(self) -> list[int]:
        return list(self.capacity)


class StaticPolicy:
    name = "static"

    def __init__(self, engines: Iterable[int]):
        self._engines = list(engines)
        if not self._engines:
            raise ValueError("static split needs at least one engine")
        self._next = 0
        self.placed: dict[Hashable, int] = {}

    def check_fits_somewhere(self, prompt: int) -> None:
        pass   # the engine's own scheduler queues and preempts

    def place(self, key: Hashable, prompt: int) -> int:
        e = self._engines[self._next % len(self._engines)]
        self._next += 1
        self.placed[key] = e
        return e

    def observe(self, engine: int, contexts: Mapping[Hashable, int]) -> None:
        pass

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


def make_policy(name: str, capacities: Mapping[int, int], *, max_response: int, growth_reserve: float = 1.0,
                budget_coef: float = 1.0, max_per_engine: int = 256):
    if name == "kv_aware":
        return KVAwarePolicy(capacities, max_response=max_response, growth_reserve=growth_reserve,
                             budget_coef=budget_coef, max_per_engine=max_per_engine)
    if name == "static":
        return StaticPolicy(sorted(capacities))
    raise ValueError(f"rollout.scheduler.policy={name!r}: use 'kv_aware' or 'static'")
