"""Where a trajectory runs: admission (rollout.scheduler.admission), shared by the MPI scheduler and
bench/rollout_balance.py. ("Policy" in this package is always the model's: the weights a step generates with.)

`KVAwareAdmission` follows rStar2-Agent's load-balanced rollout scheduler (rStar2-Agent paper §3.2, Fig. 7): a
trajectory goes to the engine with the most free KV room, only if its reservation fits, stays there for all its
turns (prefix-cache reuse), waits while nothing fits, and is admitted the moment a release frees room. What it
reserves is the difference:

    reservation(k) = min(context_k + growth, prompt_k + max_response)

context_k is the trajectory's current length as its engine rank last reported it (prompt at admission;
tool tokens included), growth = growth_reserve x max_response. growth_reserve=1 is the paper's worst case
(prompt + max response, held for the whole life): safe, but most budgets are never used, so engines run
small batches while decode pays a fixed cost per step. A smaller growth_reserve books what trajectories
hold NOW plus headroom and re-books as they grow; a rare overflow costs vLLM a preempt-and-recompute,
never a trajectory. An engine's room is kv_tokens / budget_coef (rStar2's `server_budget_coef`).

Sibling-aware (`share_prefix`, rollout.scheduler.sibling_aware): a GRPO group's samples share their prompt's KV
through vLLM's prefix cache, so the prompt is booked once per engine hosting the group and a sibling goes to an
engine already hosting it while one has room. `migration_target` answers, with the same accounting, whether a
trajectory between turns should move (rollout/levers.py: turn-boundary migration).

`StaticAdmission` is the usual baseline: trajectories split round-robin (or, `block`, contiguously) over engines up
front, each engine takes its whole share at once and lets its own scheduler (vLLM's: FCFS, preempt-and-recompute)
cope.

Both are plain bookkeeping over engine ids (no MPI, no vLLM), so the simulation and the real scheduler
decide identically from the same information: prompt lengths, engine capacities, results, and the
per-trajectory context lengths engine ranks report in their heartbeats.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping


class KVAwareAdmission:
    """KV-aware admission (module docstring). `share_prefix`: siblings of a GRPO group (same `group`, the prompt uid)
    share their prompt's KV on an engine through vLLM's prefix cache, so the prompt is booked once per engine that
    hosts the group, and a sibling goes to an engine already hosting its group while one has room (sibling-aware
    placement); without it every trajectory books its own prompt and siblings scatter over the engines."""
    name = "kv_aware"

    def __init__(self, capacities: Mapping[int, int], *, max_response: int, growth_reserve: float = 1.0,
                 budget_coef: float = 1.0, max_per_engine: int = 256, share_prefix: bool = False):
        if not capacities:
            raise ValueError("KV-aware admission needs at least one engine")
        if not 0 < growth_reserve <= 1:
            raise ValueError(f"growth_reserve must be in (0, 1], got {growth_reserve}")
        self.budget_coef = budget_coef
        self.capacity = {e: int(c / budget_coef) for e, c in capacities.items()}
        self.growth = max(1, int(growth_reserve * max_response))
        self.max_response = max_response
        self.max_per_engine = max_per_engine
        self.share_prefix = share_prefix
        self.booked = {e: 0 for e in capacities}     # sum of the reservations of the engine's trajectories
        self.count = {e: 0 for e in capacities}
        # key -> [engine, prompt tokens, reported context tokens, current reservation, group]
        self.placed: dict[Hashable, list] = {}
        self.hosts: dict[tuple, int] = {}            # (engine, group) -> live siblings there (share_prefix)

    def _reservation(self, prompt: int, context: int) -> int:
        return min(context + self.growth, prompt + self.max_response)

    def _own(self, prompt: int, context: int, group) -> int:
        """A trajectory's booking; under share_prefix its prompt is booked by the group (_host), not by it."""
        return self._reservation(prompt, context) - (prompt if self._shared(group) else 0)

    def _shared(self, group) -> bool:
        return self.share_prefix and group is not None

    def _need(self, e: int, prompt: int, context: int, group) -> int:
        """What placing a trajectory on engine e books there: its own part, plus the prompt unless e hosts it."""
        own = self._own(prompt, context, group)
        return own + (prompt if self._shared(group) and (e, group) not in self.hosts else 0)

    def _book(self, key: Hashable, e: int, prompt: int, context: int, group) -> None:
        need = self._own(prompt, context, group)
        if self._shared(group):
            n = self.hosts.get((e, group), 0)
            if n == 0:
                self.booked[e] += prompt
            self.hosts[(e, group)] = n + 1
        self.booked[e] += need
        self.count[e] += 1
        self.placed[key] = [e, prompt, context, need, group]

    def _unbook(self, key: Hashable) -> int:
        e, prompt, _, need, group = self.placed.pop(key)
        if e in self.booked:
            self.booked[e] -= need
            self.count[e] -= 1
            if self._shared(group):
                n = self.hosts.pop((e, group)) - 1
                if n:
                    self.hosts[(e, group)] = n
                else:
                    self.booked[e] -= prompt
        return e

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

    def _best(self, prompt: int, context: int, group, exclude: int | None = None) -> tuple[int | None, int]:
        """(engine, its free room after booking) for a trajectory: under share_prefix an engine hosting its group
        when one has room, else the engine with the most free room; (None, 0) when nothing fits."""
        best, best_left, best_host = None, -1, False
        for e, cap in self.capacity.items():
            if e == exclude or self.count[e] >= self.max_per_engine:
                continue
            need = self._need(e, prompt, context, group)
            free = cap - self.booked[e]
            host = self._shared(group) and (e, group) in self.hosts
            if free >= need and ((host, free - need) > (best_host, best_left)):
                best, best_left, best_host = e, free - need, host
        return best, best_left

    def place(self, key: Hashable, prompt: int, *, group: Hashable | None = None,
              context: int | None = None) -> int | None:
        """The engine `key` is admitted to (room booked), or None: wait for a release. `group`: its GRPO group
        (prompt uid; used under share_prefix); `context`: its length now when it already holds a response (a
        trajectory carried over from an earlier step), else the prompt."""
        ctx = prompt if context is None else context
        best, _ = self._best(prompt, ctx, group)
        if best is not None:
            self._book(key, best, prompt, ctx, group)
        return best

    def migration_target(self, key: Hashable, margin: float) -> int | None:
        """Where `key` (between turns: waiting for its tool call) should move, or None to stay: the engine place()
        would pick for it now, if that engine keeps more free room after taking it than `key`'s engine has now
        plus `margin` x its capacity (decode on a less loaded engine runs a smaller, cheaper batch)."""
        e, prompt, ctx, _, group = self.placed[key]
        target, left = self._best(prompt, ctx, group, exclude=e)
        if target is None or left < self.capacity[e] - self.booked[e] + margin * self.capacity[e]:
            return None
        return target

    def move(self, key: Hashable, engine: int) -> None:
        """Re-book `key` on `engine` (a migration), at its last reported context."""
        _, prompt, ctx, _, group = self.placed[key]
        self._unbook(key)
        self._book(key, engine, prompt, ctx, group)

    def observe(self, engine: int, contexts: Mapping[Hashable, int]) -> None:
        """An engine rank's report of its live trajectories' context lengths: re-book each one."""
        for key, ctx in contexts.items():
            p = self.placed.get(key)
            if p is None or p[0] != engine:
                continue   # finished, re-queued or migrated since the report was sent
            ctx = max(ctx, p[2])
            need = self._own(p[1], ctx, p[4])
            self.booked[engine] += need - p[3]
            p[2], p[3] = ctx, need

    def release(self, key: Hashable) -> None:
        self._unbook(key)

    def add_engine(self, engine: int, capacity: int) -> None:
        """An engine that joined the running step late (its policy load was slow)."""
        self.capacity[engine] = int(capacity / self.budget_coef)
        self.booked[engine] = self.count[engine] = 0

    def engine_lost(self, engine: int) -> list[Hashable]:
        """Forget a dead engine; returns the keys that were on it (the caller re-queues them)."""
        for d in (self.booked, self.count, self.capacity):
            d.pop(engine, None)
        lost = [k for k, p in self.placed.items() if p[0] == engine]
        for k in lost:
            del self.placed[k]
        for h in [h for h in self.hosts if h[0] == engine]:
            del self.hosts[h]
        return lost

    @property
    def engines(self) -> list[int]:
        return list(self.capacity)


class StaticAdmission:
    name = "static"

    def __init__(self, engines: Iterable[int], *, block: int = 1):
        """`block`: consecutive trajectories an engine takes before the next one's turn; 1 is round-robin,
        total / engines is verl's contiguous split (a GRPO group's siblings, submitted together, share an engine)."""
        self._engines = list(engines)
        if not self._engines:
            raise ValueError("static split needs at least one engine")
        self._next = 0
        self.block = max(1, block)
        self.placed: dict[Hashable, int] = {}

    def check_fits_somewhere(self, prompt: int) -> None:
        pass   # the engine's own scheduler queues and preempts

    def place(self, key: Hashable, prompt: int, **_) -> int:
        e = self._engines[(self._next // self.block) % len(self._engines)]
        self._next += 1
        self.placed[key] = e
        return e

    def observe(self, engine: int, contexts: Mapping[Hashable, int]) -> None:
        pass

    def migration_target(self, key: Hashable, margin: float) -> None:
        return None   # a static split never moves work

    def release(self, key: Hashable) -> None:
        self.placed.pop(key, None)

    def add_engine(self, engine: int, capacity: int) -> None:
        self._engines.append(engine)

    def engine_lost(self, engine: int) -> list[Hashable]:
        self._engines = [e for e in self._engines if e != engine]
        lost = [k for k, e in self.placed.items() if e == engine]
        for k in lost:
            del self.placed[k]
        return lost

    @property
    def engines(self) -> list[int]:
        return list(self._engines)


Admission = KVAwareAdmission | StaticAdmission
"""What rank 0 admits with (rollout.scheduler.admission)."""


def make_admission(name: str, capacities: Mapping[int, int], *, max_response: int, growth_reserve: float = 1.0,
                   budget_coef: float = 1.0, max_per_engine: int = 256, share_prefix: bool = False,
                   block: int = 1) -> Admission:
    if name == "kv_aware":
        return KVAwareAdmission(capacities, max_response=max_response, growth_reserve=growth_reserve,
                                budget_coef=budget_coef, max_per_engine=max_per_engine, share_prefix=share_prefix)
    if name == "static":
        return StaticAdmission(sorted(capacities), block=block)
    raise ValueError(f"rollout.scheduler.admission={name!r}: use 'kv_aware' or 'static'")


def admission_for(sc, capacities: Mapping[int, int], max_response: int) -> Admission:
    """The admission rollout.scheduler (`sc`, a SchedulerConfig) asks for, over engines of these KV capacities."""
    return make_admission(sc.admission, capacities, max_response=max_response, growth_reserve=sc.growth_reserve,
                          budget_coef=sc.budget_coef, max_per_engine=sc.max_trajectories_per_engine,
                          share_prefix=sc.sibling_aware)
