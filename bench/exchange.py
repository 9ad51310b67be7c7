"""Write+read throughput of one training step's trajectories: Arrow shards vs JSON Lines vs Parquet.

A paper-shaped step is 16,384 trajectories (512 prompts x 32 samples) of a few thousand tokens, written by
several rollout ranks and read by the trainer. The default here is scaled down (4,096 x ~2,000 tokens from
4 producers) to fit a 2-core CPU box in about a minute; --num-trajectories 16384 --mean-tokens 3000 is the
full shape. All three formats write the same Trajectory objects into the same run directory, fsync, and
publish by rename; reading ends with the token columns (response ids, loss mask, logprobs) as numpy arrays
and a sum over them, so every byte is touched. Arrow = ShardWriter/StepReader as the roles use them
(including the sha256 check on read). Reads come from the page cache for every format alike.

    python bench/exchange.py [--num-trajectories N] [--mean-tokens T] [--producers P] [--dir DIR] [--quick]

--quick: a toy step (128 trajectories of ~400 tokens from 2 producers, a few seconds) that checks the bench runs;
its ratios say little. The last stdout line is one JSON object with the figures; the exit status is 1 when Arrow
misses 5x JSONL (at --quick size too: the JSON line says which).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np
import pyarrow.parquet as pq

from rstar_hpc.exchange.atomic import atomic_write_bytes, fsync_dir
from rstar_hpc.exchange.columns import to_table, token_view
from rstar_hpc.exchange.reader import StepReader
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.synthetic.trajectories import make_step
from rstar_hpc.exchange.writer import ShardWriter

STAGE, STEP = "bench", 1
TOKEN_SUMS = ("response_ids", "loss_mask", "logprobs")


def bench_arrow(paths, shards):
    t0 = time.perf_counter()
    for producer, trajs in shards.items():
        with ShardWriter(paths, STAGE, STEP, producer, validate=False) as w:
            w.write(trajs)
    t1 = time.perf_counter()
    table = StepReader(paths, STAGE).read(STEP, list(shards))
    check = sum(float(token_view(table, c)[0].sum(dtype=np.float64)) for c in TOKEN_SUMS)
    t2 = time.perf_counter()
    size = sum(f.stat().st_size for f in paths.traj_step_dir(STAGE, STEP).glob("*.arrows"))
    return t1 - t0, t2 - t1, size, check


def bench_jsonl(folder, shards):
    t0 = time.perf_counter()
    for producer, trajs in shards.items():
        atomic_write_bytes(os.path.join(folder, f"{producer}.jsonl"),
                           "".join(t.to_json() + "\n" for t in trajs).encode())
    t1 = time.perf_counter()
    check = 0.0
    for producer in shards:
        with open(os.path.join(folder, f"{producer}.jsonl"), encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        for c in TOKEN_SUMS:   # the trainer needs arrays, not lists
            check += float(np.concatenate([np.asarray(r[c], dtype=np.float64) for r in rows]).sum())
    t2 = time.perf_counter()
    size = sum(os.path.getsize(os.path.join(folder, f"{p}.jsonl")) for p in shards)
    return t1 - t0, t2 - t1, size, check


def bench_parquet(folder, shards):
    t0 = time.perf_counter()
    for producer, trajs in shards.items():
        final = os.path.join(folder, f"{producer}.parquet")
        tmp = final + ".tmp"
        pq.write_table(to_table(trajs), tmp)   # pyarrow's default codec (snappy)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(folder)
    t1 = time.perf_counter()
    check = 0.0
    for producer in shards:
        table = pq.read_table(os.path.join(folder, f"{producer}.parquet"))
        check += sum(float(token_view(table, c)[0].sum(dtype=np.float64)) for c in TOKEN_SUMS)
    t2 = time.perf_counter()
    size = sum(os.path.getsize(os.path.join(folder, f"{p}.parquet")) for p in shards)
    return t1 - t0, t2 - t1, size, check


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-trajectories", type=int, default=4096)
    ap.add_argument("--mean-tokens", type=int, default=2000)
    ap.add_argument("--producers", type=int, default=4)
    ap.add_argument("--dir", default=None, help="Where to write (default: a temp dir, removed afterwards); "
                                                 "point it at Lustre to measure the shared file system.")
    ap.add_argument("--quick", action="store_true", help="a toy step (smoke test); explicit flags still win")
    args = ap.parse_args()
    if args.quick:
        ap.set_defaults(num_trajectories=128, mean_tokens=400, producers=2)
        args = ap.parse_args()

    # -- data: the same Trajectory objects for every format ------------------------------------------------------
    per = args.num_trajectories // args.producers
    shards = {f"rollout-{r}": make_step("bench", STAGE, STEP, per // 16, 16, mean_tokens=args.mean_tokens,
                                        engine_rank=r) for r in range(args.producers)}
    rows = sum(len(v) for v in shards.values())
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for v in shards.values() for t in v)
    print(f"step: {rows} trajectories, {tokens / 1e6:.1f} M tokens, {args.producers} producers")

    root = tempfile.mkdtemp(prefix="bench-exchange-", dir=args.dir)
    try:
        paths = RunPaths(os.path.join(root, "run"))
        paths.create()
        other = os.path.join(root, "other")
        os.makedirs(other)
        # warm-up on a tiny step, so lazy imports (pyarrow.dataset for Parquet) are not timed
        tiny = {"rollout-0": make_step("bench", STAGE, STEP, 1, 2, mean_tokens=50)}
        warm = RunPaths(os.path.join(root, "warm"))
        os.makedirs(os.path.join(root, "warm-other"))
        for fn, target in ((bench_arrow, warm), (bench_jsonl, os.path.join(root, "warm-other")),
                           (bench_parquet, os.path.join(root, "warm-other"))):
            fn(target, tiny)
        results = {}
        for name, fn, target in (("arrow", bench_arrow, paths), ("jsonl", bench_jsonl, other),
                                 ("parquet", bench_parquet, other)):
            write_s, read_s, size, check = fn(target, shards)
            results[name] = {"write_s": round(write_s, 3), "read_s": round(read_s, 3),
                             "total_s": round(write_s + read_s, 3), "bytes": size,
                             "write_MBps": round(size / write_s / 1e6, 1), "read_MBps": round(size / read_s / 1e6, 1),
                             "rows_per_s": round(rows / (write_s + read_s)), "check": check}
            print(f"{name:8s} write {write_s:7.2f}s  read {read_s:7.2f}s  size {size / 2**20:8.1f} MiB")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    checks = {r.pop("check") for r in results.values()}
    if len(checks) != 1 and not np.allclose(list(checks), list(checks)[0], rtol=1e-6):
        raise SystemExit(f"formats disagree on the data read back: {checks}")

    a, j, p = results["arrow"], results["jsonl"], results["parquet"]
    ratios = {
        "arrow_vs_jsonl_write": round(j["write_s"] / a["write_s"], 2),
        "arrow_vs_jsonl_read": round(j["read_s"] / a["read_s"], 2),
        "arrow_vs_jsonl_total": round(j["total_s"] / a["total_s"], 2),
        "arrow_vs_parquet_total": round(p["total_s"] / a["total_s"], 2),
    }
    for k, v in ratios.items():
        print(f"{k:24s} {v:6.2f}x")
    verdict = "meets" if ratios["arrow_vs_jsonl_total"] >= 5 else "MISSES"
    print(f"Arrow write+read is {ratios['arrow_vs_jsonl_total']:.1f}x JSONL: {verdict} the >= 5x target")
    print(json.dumps({"bench": "exchange", "trajectories": rows, "tokens": tokens, "producers": args.producers,
                      "mean_tokens": args.mean_tokens, **{k: v for k, v in results.items()}, **ratios,
                      "target_arrow_vs_jsonl": 5.0, "meets_target": ratios["arrow_vs_jsonl_total"] >= 5}))
    if ratios["arrow_vs_jsonl_total"] < 5:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
