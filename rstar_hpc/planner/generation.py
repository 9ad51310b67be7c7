"""One engine's generation time for an rl step: engine_sim.py's engine model, long tail included.

The engines of a step are alike and admission balances them (rollout.scheduler.admission), so one engine with its
share of the step's trajectories (ceil(trajectories / engines)) stands for all. Its trajectories are drawn from
the stage's length distribution (rates.py: log-normal, cut at the budget; tool calls as turns with the tool's
latency and output tokens). The simulation gives the makespan (the step's generation wall time: the last
trajectory's end, the long tail included) and the engine's busy time (its idle fraction is the tail).

Simulating thousands of trajectories per engine is slow in Python, and past the first wave an engine is in a
steady state: its makespan grows linearly with its trajectories. So a share above SIM_MAX is simulated at
SIM_MAX / 2 and SIM_MAX and extrapolated along that line (makespan and busy time alike).
"""
from __future__ import annotations

import math
import random
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

from rstar_hpc.planner import engine_sim as sim
from rstar_hpc.planner.rates import ALLREDUCE_S, LENGTH_SIGMA, Rates

SIM_MAX = 768
SEED = 0


@dataclass(frozen=True)
class Engine:
    """The engine model's constants (engine_sim's names) for one engine of `tp` GPUs."""

    c0: float
    c1: float
    c2: float
    prefill: float
    kv_tokens: int
    max_num_seqs: int


@dataclass(frozen=True)
class Workload:
    trajectories: int       # on this engine
    mean_response: float    # tokens, model and tool tokens
    budget: int             # response tokens at most
    prompt: int
    max_turns: int


def engine_constants(shape, n_params: int, rates: Rates, tp: int, memory_utilization: float,
                     max_num_seqs: int) -> Engine:
    """The engine model's constants from the hardware and the model (rates.py explains each). A mixture of experts
    holds and, at a batch's width, reads all its weights per decode step; its prefill computes the active ones."""
    weights = 2.0 * n_params                                                      # bf16
    kv_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2   # K and V, bf16
    bw = tp * rates.hbm_tbs * 1e12 * rates.decode_efficiency
    c0 = weights / bw + (2 * shape.num_layers * ALLREDUCE_S if tp > 1 else 0.0)
    prefill = 2.0 * shape.active_params / (tp * rates.peak_tflops * 1e12 * rates.prefill_mfu)
    free = tp * rates.memory_gb * 1e9 * memory_utilization - weights
    if free <= kv_per_token * 1024:
        raise ValueError(f"an engine of {tp} x {rates.memory_gb:g} GB at gpu_memory_utilization {memory_utilization} "
                         f"has no room for KV after {weights / 1e9:.0f} GB of weights; raise "
                         f"rollout.engine.tensor_parallel_size")
    return Engine(c0, sim.C1, kv_per_token / bw, prefill, int(free // kv_per_token), max_num_seqs)


@contextmanager
def _constants(engine: Engine, budget: int):
    names = {"C0": engine.c0, "C1": engine.c1, "C2": engine.c2, "PREFILL": engine.prefill,
             "KV_TOKENS": engine.kv_tokens, "MAX_NUM_SEQS": engine.max_num_seqs, "MAX_RESPONSE": budget}
    saved = {k: getattr(sim, k) for k in names}
    for k, v in names.items():
        setattr(sim, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(sim, k, v)


def _pool(w: Workload, n: int, rates: Rates) -> list:
    """n trajectories of the workload: a log-normal response length with the stage's mean, cut at the budget, made
    of turns split by its tool calls (a Poisson number with the rates' mean, at most max_turns - 1)."""
    rng = random.Random(SEED)
    mu = math.log(w.mean_response) - LENGTH_SIGMA ** 2 / 2
    out = []
    for i in range(n):
        length = min(w.budget, max(16, int(rng.lognormvariate(mu, LENGTH_SIGMA))))
        calls = min(w.max_turns - 1, _poisson(rng, rates.tool_calls_per_traj))
        calls = min(calls, max(0, (length - 16) // (rates.tool_tokens + 16)))
        generated = length - calls * rates.tool_tokens
        cuts = sorted(rng.randint(1, generated - 1) for _ in range(calls)) if calls else []
        pieces = [b - a for a, b in zip([0, *cuts], [*cuts, generated])]
        turns = [(max(1, p), rates.tool_tokens, rates.tool_latency_s) for p in pieces[:-1]]
        turns.append((max(1, pieces[-1]), 0, 0.0))
        out.append(sim.Traj(id=i, prompt=w.prompt, turns=turns, group=i))
    for t in out:
        t.reset()
    return out


def _poisson(rng: random.Random, mean: float) -> int:
    k, p, limit = 0, rng.random(), math.exp(-mean)
    while p > limit:
        k += 1
        p *= rng.random()
    return k


@lru_cache(maxsize=256)
def _simulate(engine: Engine, w: Workload, n: int, rates_key: tuple) -> tuple[float, float]:
    rates = Rates(tool_latency_s=rates_key[0], tool_calls_per_traj=rates_key[1], tool_tokens=rates_key[2])
    with _constants(engine, w.budget):
        s = sim.Sim(1, "kv_aware", share=True)
        r = s.run_step(_pool(w, n, rates))
    return r["makespan_s"], s.busy_s


def generation(engine: Engine, w: Workload, rates_key: tuple) -> dict:
    """{"generation_s", "busy_s", "idle_fraction"} of one engine's share of a step; rates_key: (tool latency s,
    tool calls per trajectory, tool tokens per call)."""
    n, w = w.trajectories, Workload(0, w.mean_response, w.budget, w.prompt, w.max_turns)
    if n <= SIM_MAX:
        span, busy = _simulate(engine, w, n, rates_key)
    else:
        (s1, b1), (s2, b2) = (_simulate(engine, w, m, rates_key) for m in (SIM_MAX // 2, SIM_MAX))
        per = (s2 - s1) / (SIM_MAX - SIM_MAX // 2)
        span = s2 + per * (n - SIM_MAX)
        busy = b2 + (b2 - b1) / (SIM_MAX - SIM_MAX // 2) * (n - SIM_MAX)
    return {"generation_s": span, "busy_s": min(busy, span), "idle_fraction": max(0.0, 1 - busy / span)}
