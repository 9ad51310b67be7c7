"""The rollout engine model: one or several rollout steps on N vLLM-like engines, admission through
rstar_hpc/rollout/admission.py, and the long-tail levers. The planner (generation.py) simulates a stage's step with
it; bench/rollout_balance.py compares admission policies and levers on it.

An engine is an FCFS queue admitted while the KV held by running requests fits (`KV_TOKENS`), at most
`MAX_NUM_SEQS` running; a request that cannot grow preempts the most recently admitted one, which is recomputed
later (vLLM v1); a turn after a tool call reuses its prefix cache unless the engine needed the room. Time per
decode step is c0 + c1*batch + c2*(context tokens read), prefill p per uncached token.

`share=True` models GRPO siblings sharing their prompt's KV through vLLM's prefix cache: on one engine a group's
prompt is held once however many siblings run there (memory), and prefilled once while a sibling that holds it is
live there (compute). Attention still reads the prompt once per sequence (c2), as it does on a real engine.

The levers (each off unless asked):
- sibling-aware placement (`sibling_aware`): admission books a group's prompt once per engine and sends a sibling
  where its group already is while that engine has room (KVAwareAdmission share_prefix);
- turn-boundary migration (`migrate_margin`): when a trajectory's tool result is back and the step's queue is
  empty (its tail), admission may move its next turn to an engine with more free KV (migration_target); the
  target re-prefills its whole context, less the prompt where a sibling already holds it;
- partial rollouts (run_partial): a step closes once `close_groups` groups are complete; every unfinished
  trajectory is paused, keeps its tokens, and resumes in the next step on the new policy, which re-prefills its
  context (the old KV belongs to the old weights). Tokens are tagged with the step (policy version) that made them.
"""
from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from dataclasses import dataclass, field

from rstar_hpc.rollout.admission import make_admission

C0, C1, C2, PREFILL = 1.2e-2, 4e-5, 5e-8, 6e-5     # seconds
KV_TOKENS, MAX_NUM_SEQS = 280_000, 256          # 14B-class model, bf16 KV, 80 GB GPU
MAX_RESPONSE, MAX_TURNS = 8192, 10
REPORT_S = 0.5                                     # heartbeat period of an engine rank
CHUNK = 8                                          # decode steps simulated at once (joins wait at most this)


@dataclass
class Traj:
    id: int
    prompt: int
    turns: list            # [(gen_tokens, tool_tokens, tool_latency_s)]; the last turn has no tool
    group: int = 0         # GRPO group (prompt uid): siblings share the prompt
    turn: int = 0
    left: int = 0          # tokens still to generate in the current turn
    ctx: int = 0           # tokens in context (KV) now
    uncached: int = 0      # tokens to prefill before decoding resumes
    done_at: float = 0.0
    admitted_at: float = 0.0
    finished: bool = False
    cold: bool = True      # its KV is gone (fresh, carried, migrated, preempted): the next join prefills all of it
    why: str = ""          # what made it cold: "migrated" / "carried" (re-prefill accounting), else ""
    warm_on: int = -1      # engine whose prefix cache holds its prompt on its behalf
    wait_s: float = 0.0    # carried while its tool ran: seconds of tool latency left at the next step's start
    tool_at: float = -1.0  # when its pending tool result comes back (-1: none pending)
    gen: Counter = field(default_factory=Counter)   # generated tokens by step (= policy version)

    def reset(self) -> None:
        self.turn, self.left, self.ctx, self.uncached = 0, self.turns[0][0], self.prompt, self.prompt
        self.done_at = self.admitted_at = self.wait_s = 0.0
        self.finished, self.cold, self.why, self.warm_on, self.tool_at = False, True, "", -1, -1.0
        self.gen = Counter()


def step_cost(batch: int, ctx_sum: int, k: int) -> float:
    """k decode steps of `batch` sequences whose contexts sum to ctx_sum and grow by one token a step."""
    return k * (C0 + C1 * batch + C2 * ctx_sum) + C2 * batch * k * (k - 1) / 2


@dataclass
class Engine:
    id: int
    queue: list = field(default_factory=list)      # submitted, not running (FCFS)
    running: list = field(default_factory=list)    # decoding, in admission order
    warm: Counter = field(default_factory=Counter)  # group -> live trajectories here whose prompt KV it holds
    busy_s: float = 0.0
    ticking: bool = False
    preemptions: int = 0
    recomputed: int = 0

    def kv_used(self, share: bool) -> int:
        used = sum(t.ctx for t in self.running)
        if share:   # a group's prompt is held once
            seen: set = set()
            for t in self.running:
                if t.group in seen:
                    used -= t.prompt
                seen.add(t.group)
        return used

    def prompt_held(self, t: Traj, share: bool) -> bool:
        """A sibling of t live here holds t's prompt in the prefix cache."""
        return share and self.warm[t.group] - (t.warm_on == self.id) > 0


class Sim:
    """Engines and an admission; run_step() simulates one step of a pool of trajectories. Counters accumulate."""

    def __init__(self, n_engines: int, admission: str, *, growth_reserve: float = 1.0, budget_coef: float = 1.0,
                 report_s: float = REPORT_S, share: bool = False, sibling_aware: bool = False, block: int = 1,
                 migrate_margin: float | None = None):
        self.n, self.admission, self.report_s = n_engines, admission, report_s
        self.kw = dict(growth_reserve=growth_reserve, budget_coef=budget_coef, max_per_engine=MAX_NUM_SEQS,
                       share_prefix=sibling_aware, block=block)
        self.share, self.margin = share, migrate_margin
        self.migrations = 0
        self.prefill = Counter()   # tokens prefilled by cause: migrated / carried / other
        self.preemptions = self.recomputed = 0
        self.busy_s = 0.0

    # long: one event loop (admission, tool returns, migration, decode chunks, step close) reads best in one piece
    def run_step(self, pool: list[Traj], step: int = 0, group_left: dict | None = None,
                 close_groups: int | None = None) -> dict:
        """Simulate one step of `pool` (carried first, then fresh) until every trajectory is done, or, with
        `close_groups`, until that many groups are complete (`group_left`: unfinished members per group, updated).
        Returns the step's figures; unfinished trajectories are left paused (see pause())."""
        share = self.share
        engines = [Engine(e) for e in range(self.n)]
        placer = make_admission(self.admission, {e: KV_TOKENS for e in range(self.n)}, max_response=MAX_RESPONSE,
                             **self.kw)
        live: list[dict] = [{} for _ in range(self.n)]
        reported = [0.0] * self.n
        events: list = []
        seq = 0
        pending = deque(pool)
        completed, closed_at = 0, None

        def push(time_, kind, e, t=None):
            nonlocal seq
            seq += 1
            heapq.heappush(events, (time_, seq, kind, e, t))

        def wake(eng: Engine, now: float) -> None:
            if not eng.ticking:
                eng.ticking = True
                push(now, "tick", eng.id)

        def admit(now: float) -> None:
            while pending:
                t = pending[0]
                e = placer.place(t.id, t.prompt, group=t.group, context=t.ctx)
                if e is None:   # FCFS at the scheduler: nothing behind it jumps the queue
                    break
                pending.popleft()
                t.admitted_at = now
                live[e][t.id] = t
                if t.wait_s > 0:   # carried while its tool ran: joins when the result is back
                    t.tool_at = now + t.wait_s
                    push(t.tool_at, "tool", e, t)
                    t.wait_s = 0.0
                else:
                    engines[e].queue.append(t)
                    wake(engines[e], now)

        def leave(t: Traj, eng: Engine) -> None:
            if t.warm_on == eng.id:
                eng.warm[t.group] -= 1
                t.warm_on = -1

        def engine_admit(eng: Engine) -> None:
            used = eng.kv_used(share)
            groups = {t.group for t in eng.running} if share else ()
            while eng.queue and len(eng.running) < MAX_NUM_SEQS:
                t = eng.queue[0]
                need = t.ctx - (t.prompt if t.group in groups else 0)
                if used + need + CHUNK > KV_TOKENS:
                    break
                eng.queue.pop(0)
                if t.cold and eng.prompt_held(t, share):
                    t.uncached -= t.prompt
                self.prefill[t.why or "other"] += t.uncached
                t.cold, t.why = False, ""
                if t.warm_on != eng.id:
                    eng.warm[t.group] += 1
                    t.warm_on = eng.id
                eng.running.append(t)
                used += need
                if share:
                    groups.add(t.group)

        admit(0.0)
        while events:
            now, _, kind, e, t = heapq.heappop(events)
            if kind == "close":
                closed_at = now
                break
            eng = engines[e]
            if kind == "tool":
                t.tool_at = -1.0
                if self.margin is not None and not pending:   # the step's tail: rebalance at the turn boundary
                    target = placer.migration_target(t.id, self.margin)
                    if target is not None:
                        placer.move(t.id, target)
                        leave(t, eng)
                        del live[e][t.id]
                        e, eng = target, engines[target]
                        live[e][t.id] = t
                        t.cold, t.why = True, "migrated"
                        self.migrations += 1
                if t.cold:
                    t.uncached = t.ctx
                else:   # its prefix is still cached unless the engine needed the room
                    t.uncached = t.turns[t.turn - 1][1] if eng.kv_used(share) + t.ctx <= KV_TOKENS else t.ctx
                eng.queue.append(t)
                wake(eng, now)
                continue
            if now - reported[e] >= self.report_s:   # the engine rank's heartbeat: its trajectories' contexts
                placer.observe(e, {i: x.ctx for i, x in live[e].items()})
                reported[e] = now
            engine_admit(eng)
            if not eng.running:
                eng.ticking = False
                continue
            # grow: preempt the most recently admitted until this chunk's growth fits (vLLM v1 recompute)
            while len(eng.running) > 1 and eng.kv_used(share) + CHUNK * len(eng.running) > KV_TOKENS:
                victim = eng.running.pop()
                victim.uncached, victim.cold = victim.ctx, True
                eng.preemptions += 1
                eng.recomputed += victim.ctx
                eng.queue.insert(0, victim)
            batch = eng.running
            k = max(1, min(CHUNK, min(x.left for x in batch)))
            dur = step_cost(len(batch), sum(x.ctx for x in batch), k) + PREFILL * sum(x.uncached for x in batch)
            eng.busy_s += dur
            end = now + dur
            still, freed = [], False
            for x in batch:
                x.uncached = 0
                x.left -= k
                x.ctx += k
                x.gen[step] += k
                if x.left > 0:
                    still.append(x)
                    continue
                _, tool, lat = x.turns[x.turn]
                x.turn += 1
                if x.turn < len(x.turns):
                    x.ctx += tool
                    x.left = x.turns[x.turn][0]
                    x.tool_at = end + lat
                    push(x.tool_at, "tool", e, x)
                    continue
                x.done_at, x.finished = end, True
                placer.release(x.id)
                del live[e][x.id]
                leave(x, eng)
                freed = True
                if group_left is not None:
                    group_left[x.group] -= 1
                    if group_left[x.group] == 0:
                        completed += 1
                        if close_groups is not None and completed == close_groups:
                            push(end, "close", e)
            eng.running = still
            push(end, "tick", e)
            if freed:
                admit(end)
        if closed_at is None:
            assert all(t.finished for t in pool), "a step ended with unfinished trajectories and no close"
            closed_at = max(t.done_at for t in pool)
        else:
            self.pause(pool, closed_at)
        self.preemptions += sum(x.preemptions for x in engines)
        self.recomputed += sum(x.recomputed for x in engines)
        busy = sum(x.busy_s for x in engines)
        self.busy_s += busy
        admitted = [t.admitted_at for t in pool if t.finished or t.gen[step]]
        return {"makespan_s": closed_at, "idle_fraction": 1 - busy / (self.n * closed_at),
                "last_admit_s": max(admitted, default=0.0), "completed_groups": completed,
                "preemptions": sum(x.preemptions for x in engines),
                "recomputed_tokens": sum(x.recomputed for x in engines)}

    @staticmethod
    def pause(pool: list[Traj], closed_at: float) -> None:
        """The step closed: every unfinished trajectory keeps its tokens and state; its KV is gone (the next step
        runs new weights), and a tool call still running finishes during the pause or after the next start."""
        for t in pool:
            if t.finished:
                continue
            if t.tool_at >= 0:
                t.wait_s = max(0.0, t.tool_at - closed_at)
            t.tool_at, t.warm_on, t.uncached = -1.0, -1, t.ctx
            t.cold, t.why = True, ("carried" if t.gen else "")


def run_partial(groups: list[list[Traj]], n_engines: int, admission: str, *, batch_groups: int,
                close_fraction: float, steps: int, **sim_kw) -> dict:
    """Partial rollouts over `steps` steps, as rollout.scheduler.partial_rollouts runs them: a step's pool is the
    groups carried from the step before (first) and batch_groups fresh ones; it closes once close_fraction of the
    pool's groups are complete, which are what it trains. In steady state the carry holds
    batch_groups x (1 - f) / f groups and a step trains batch_groups. A real run reaches it over its first steps
    (the carry grows by a factor 1 - f a step); the simulation starts there: step 0 takes batch_groups / f fresh
    groups (no carry yet: its close is cold), and the figures are the steps after it, normalised to batch_groups
    groups a step. Staleness: each trained token's versions behind = training step - the step
    that generated it (a finished sibling waiting for its group counts too)."""
    sim = Sim(n_engines, admission, **sim_kw)
    fresh = iter(groups)
    carried: list[Traj] = []
    group_left: dict[int, int] = {}
    members: dict[int, list[Traj]] = {}
    lag, carried_lag = Counter(), Counter()
    trained_ids: set[int] = set()
    times, per_step = [], []
    for s in range(steps):
        live_groups = {t.group for t in carried}
        pool = list(carried)
        n_fresh = math.ceil(batch_groups / close_fraction) if s == 0 else batch_groups
        for _ in range(n_fresh):
            g = next(fresh)
            for t in g:
                t.reset()
            members[g[0].group] = g
            group_left[g[0].group] = len(g)
            pool += g
        r = sim.run_step(pool, s, group_left,
                         close_groups=math.ceil(close_fraction * (len(live_groups) + n_fresh) - 1e-9))
        done_groups = [g for g, left in group_left.items() if left == 0]
        for g in done_groups:
            del group_left[g]
            for t in members.pop(g):
                assert t.id not in trained_ids, "a trajectory trained twice"
                trained_ids.add(t.id)
                was_carried = len(t.gen) > 1 or min(t.gen) < s
                for st, k in t.gen.items():
                    lag[s - st] += k
                    if was_carried:
                        carried_lag[s - st] += k
        carried = [t for t in pool if not t.finished]
        r["trained_groups"] = len(done_groups)
        per_step.append(r)
        if s:
            times.append(r["makespan_s"] * batch_groups / len(done_groups))
    total = sum(lag.values())
    return {"makespan_s": sum(times) / len(times), "steps": [round(r["makespan_s"], 2) for r in per_step],
            "trained_groups": [r["trained_groups"] for r in per_step],
            "carried_trajectories_at_end": len(carried),
            "staleness_tokens": {str(k): lag[k] for k in sorted(lag)},
            "stale_token_fraction": round(1 - lag[0] / total, 4) if total else 0.0, "trained_tokens": total,
            "carried_staleness_tokens": {str(k): carried_lag[k] for k in sorted(carried_lag)},
            "reprefill_tokens": dict(sim.prefill), "migrations": sim.migrations,
            "preemptions": sim.preemptions}
