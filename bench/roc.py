"""Benchmark: reward + quality penalties + Resample-on-Correct + advantages for one paper-sized step
(512 prompts x 32 rollouts, paper §4.3) against a naive per-trajectory Python loop, in the same run.

    .venv/bin/python bench/roc.py [--prompts 512] [--naive-prompts 48] [--seed 0] [--quick]

--quick: 16 prompts, the naive loop on 4 of them (a smoke test of the bench; the timings say little).

Synthetic rollouts look like real ones: <reason> text, 0-4 Hermes tool calls with sandbox statuses and
<tool_response> blocks, ChatML turn markers, an <answer> with \\boxed{} (sometimes repeated, sometimes
missing as in a truncated trace); 90% of ground truths are integers (the paper's RL data), the rest
fractions and expressions that need math-verify; two answers are pathological (a power tower), which the
library scores 0 at its time limit. Per-prompt pass rates spread from 0 to 1, so many groups are all-equal.

The naive loop calls math-verify in-process on every response and does RoC and advantages per group in
plain Python, the way a first implementation would. It cannot survive the pathological answers and is slow,
so it runs on the first --naive-prompts prompts (which hold no pathological answer) and is extrapolated
linearly (prompts are i.i.d.); on those prompts its rewards, penalties and top-k selection must equal the
library's, which the bench checks. The last stdout line is one JSON object of the figures.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rstar_hpc.algo import RewardScorer, group_advantages, roc_downsample, roc_metrics, trajectory_quality  # noqa: E402
from rstar_hpc.algo.quality import FAILED_TOOL_STATUSES  # noqa: E402
from rstar_hpc.config.algo import AlgoConfig  # noqa: E402

STATUSES = ["ok"] * 14 + ["error"] * 3 + ["timeout", "output_truncated", "parse_error", "memory"]
WORDS = ("let us consider the sum over all residues modulo the prime so the count of valid pairs equals the "
         "number of lattice points inside the region which we can verify by direct computation").split()
HARD_TRUTHS = [(r"\frac{1}{2}", [r"\frac{2}{4}", "0.5"], r"\frac{1}{3}"),
               (r"\sqrt{2}", [r"\sqrt{2}", "2^{1/2}"], "1.41"),
               (r"2\pi", [r"2\pi", r"\pi \cdot 2"], r"\pi"), (r"\frac{3}{4}", [r"\frac{6}{8}", "0.75"], "0.7")]
POWER_TOWER = r"9^{9^{9^{9}}}"


def reasoning(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_response(rng: random.Random, answer: str | None, n_calls: int, dup_answer: bool) -> tuple[str, list[str]]:
    parts, statuses = [f"<reason>{reasoning(rng, 120)}"], []
    for _ in range(n_calls):
        status = rng.choice(STATUSES)
        statuses.append(status)
        code = json.dumps({"name": "python_code_with_standard_io",
                           "arguments": {"code": "print(sum(i*i for i in range(100)))", "input": ""}})
        out = "328350" if status in ("ok", "output_truncated") else f"Traceback: {status}"
        parts.append(f"\n<tool_call>{code}</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{out}\n"
                     f"</tool_response><|im_end|>\n<|im_start|>assistant\n<reason>{reasoning(rng, 60)}")
    parts.append("</reason>\n")
    if answer is not None:
        parts.append(f"<answer>The answer is \\boxed{{{answer}}}.</answer>")
        if dup_answer:
            parts.append(f" Double-check. <answer>\\boxed{{{answer}}}</answer>")
    parts.append("<|im_end|>")
    return "".join(parts), statuses


def make_step(num_prompts: int, rollouts: int, seed: int, naive_prompts: int):
    rng = random.Random(seed)
    uids, responses, truths, statuses, turns = [], [], [], [], []
    for p in range(num_prompts):
        hard = rng.random() < 0.1
        if hard:
            truth, right_forms, wrong = rng.choice(HARD_TRUTHS)
        else:
            truth = str(rng.randint(0, 10**rng.randint(1, 6)))
            right_forms, wrong = [truth], str(int(truth) + rng.randint(1, 9))
        pass_rate = rng.choice([0.0, 0.0, 1.0, 1.0, rng.random(), rng.random(), rng.random()])
        for _ in range(rollouts):
            correct = rng.random() < pass_rate
            answer = rng.choice(right_forms) if correct else wrong
            if rng.random() < 0.05:
                answer = None  # truncated: no answer
            n_calls = rng.choice([0, 1, 1, 2, 2, 3, 4])
            resp, st = make_response(rng, answer, n_calls, dup_answer=rng.random() < 0.1)
            uids.append(f"prompt-{p}")
            responses.append(resp)
            truths.append(truth)
            statuses.append(st)
            turns.append(n_calls + 1)
    # pathological answers, outside the prompts the naive loop runs on (it would hang on them)
    for i in (naive_prompts * rollouts + 3, len(responses) - 5):
        responses[i], _ = make_response(rng, POWER_TOWER, 1, False)
        statuses[i], turns[i] = ["ok"], 2
    return uids, responses, truths, statuses, turns


# --------------------------------------------------------------------------------------------------
# the naive per-trajectory loop


def naive_step(uids, responses, truths, statuses, turns, target, min_zero, min_nonzero):
    from math_verify import parse, verify

    rewards, penalties = [], []
    for resp, truth, st, n_turns in zip(responses, truths, statuses, turns):
        text = re.sub(r"<tool_response>.*?</tool_response>", "", resp, flags=re.S)
        blocks = re.findall(r"<answer>(.*?)</answer>", text, re.S)
        boxed = [b for blk in blocks for b in re.findall(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}", blk)]
        ok = bool(boxed) and verify(parse(f"\\boxed{{{truth}}}"), parse(f"\\boxed{{{boxed[-1].strip()}}}"))
        rewards.append(1.0 if ok else 0.0)
        p_err = sum(s in FAILED_TOOL_STATUSES for s in st) / len(st) if st else 0.5
        n_ans = len(blocks)
        balanced = text.count("<answer>") == text.count("</answer>") == n_ans
        p_fmt = 1.0 if n_ans == 0 or not balanced else min(1.0, (n_ans - 1) / n_turns)
        penalties.append(p_err + p_fmt)
    groups: dict[str, list[int]] = {}
    for i, u in enumerate(uids):
        groups.setdefault(u, []).append(i)
    keep, adv = [False] * len(uids), {}
    for members in groups.values():
        pos = [i for i in members if rewards[i] != 0]
        neg = [i for i in members if rewards[i] == 0]
        if not pos or not neg or len(members) < target:
            continue
        k_neg, k_pos = round(len(neg) * target / len(members)), round(len(pos) * target / len(members))
        if k_neg <= min(min_zero, len(neg)):
            k_neg = min(min_zero, len(neg))
            k_pos = target - k_neg
        if k_pos <= min(min_nonzero, len(pos)):
            k_pos = min(min_nonzero, len(pos))
            k_neg = target - k_pos
        kept = sorted(pos, key=lambda i: penalties[i])[:k_pos] + neg[:k_neg]
        r = [rewards[i] for i in kept]
        mean, std = statistics.mean(r), statistics.stdev(r)
        for i in kept:
            keep[i] = True
            adv[i] = (rewards[i] - mean) / (std + 1e-6)
    return rewards, penalties, keep, adv


# --------------------------------------------------------------------------------------------------


def library_step(cfg: AlgoConfig, scorer: RewardScorer, uids, responses, truths, statuses, turns, seed):
    t = {}
    t0 = time.perf_counter()
    results = scorer.score_batch(responses, truths)
    rewards = np.array([r.score for r in results])
    t["reward_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    qs = [trajectory_quality(r, s, n, cfg.roc) for r, s, n in zip(responses, statuses, turns)]
    p_err, p_fmt = np.array([q.p_err for q in qs]), np.array([q.p_format for q in qs])
    t["quality_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sel = roc_downsample(uids, rewards, p_err, p_fmt, cfg.roc, seed=seed)
    t["roc_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    adv = group_advantages(rewards[sel.keep], np.asarray(uids)[sel.keep], cfg.loss)
    t["advantage_s"] = time.perf_counter() - t0
    return results, rewards, p_err + p_fmt, sel, adv, t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--rollouts", type=int, default=32)
    ap.add_argument("--naive-prompts", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a small step (smoke test); explicit flags still win")
    args = ap.parse_args()
    if args.quick:
        ap.set_defaults(prompts=16, naive_prompts=4)
        args = ap.parse_args()
    logging.disable(logging.WARNING)  # math-verify's per-call timeout warnings in the naive loop

    t0 = time.perf_counter()
    data = make_step(args.prompts, args.rollouts, args.seed, args.naive_prompts)
    uids, responses, truths, statuses, turns = data
    print(f"synthesised {len(responses)} rollouts ({sum(map(len, responses)) / 2**20:.1f} MiB of text) "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)

    cfg = AlgoConfig()
    with RewardScorer(cfg.reward) as scorer:
        t0 = time.perf_counter()
        scorer.score_batch(responses[:1] + [r"<answer>\boxed{\frac{1}{2}}</answer>"], ["0", "0.5"])  # start the pool
        startup = time.perf_counter() - t0
        t0 = time.perf_counter()
        results, rewards, penalty, sel, adv, parts = library_step(cfg, scorer, *data, seed=args.seed)
        lib_s = time.perf_counter() - t0
        workers = scorer.num_workers
    print(f"library: {lib_s:.2f} s " + " ".join(f"{k}={v:.3f}" for k, v in parts.items()), flush=True)

    # the naive loop on the first prompts, checked against the library (top-k mode is deterministic)
    n = args.naive_prompts * args.rollouts
    t0 = time.perf_counter()
    n_rewards, n_pen, n_keep, n_adv = naive_step(uids[:n], responses[:n], truths[:n], statuses[:n], turns[:n],
                                                 cfg.roc.down_sample_to_n, cfg.roc.min_zero_reward_trace_num,
                                                 cfg.roc.min_non_zero_reward_trace_num)
    naive_s = time.perf_counter() - t0
    naive_extrapolated = naive_s * args.prompts / args.naive_prompts
    topk = roc_downsample(uids[:n], rewards[:n], penalty[:n], np.zeros(n), cfg.roc, seed=args.seed,
                          positive_selection="topk", roc_answer_format=False)
    checks = {
        "rewards_equal": bool(np.array_equal(n_rewards, rewards[:n])),
        "penalties_equal": bool(np.allclose(n_pen, penalty[:n])),
        "topk_selection_equal_on_positives": bool(all(
            topk.keep[i] == n_keep[i] for i in range(n) if rewards[i] != 0)),
    }
    print(f"naive: {naive_s:.2f} s on {args.naive_prompts} prompts -> {naive_extrapolated:.1f} s for "
          f"{args.prompts}; checks {checks}", flush=True)

    reasons: dict[str, int] = {}
    for r in results:
        reasons[r.reason] = reasons.get(r.reason, 0) + 1
    m = roc_metrics(sel, rewards)
    figures = {
        "bench": "roc", "prompts": args.prompts, "rollouts": len(responses), "cpu_cores": len(os.sched_getaffinity(0)),
        "verifier_workers": workers, "pool_startup_s": round(startup, 3), "library_s": round(lib_s, 3),
        **{f"library_{k}": round(v, 4) for k, v in parts.items()},
        "naive_prompts_measured": args.naive_prompts, "naive_measured_s": round(naive_s, 3),
        "naive_extrapolated_s": round(naive_extrapolated, 2), "speedup": round(naive_extrapolated / lib_s, 1),
        "reward_reasons": reasons, "kept": int(sel.keep.sum()),
        "pass_rate_before": round(m["roc/pass_rate_before"], 4), "pass_rate_after": round(m["roc/pass_rate_after"], 4),
        "groups_rejected_equal": int(m["roc/groups_rejected_equal"]), "adv_mean": round(float(adv.mean()), 6),
        **checks,
    }
    print(json.dumps(figures))
    if not all(checks.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
