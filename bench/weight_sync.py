"""Weight sync, trainer -> one vLLM engine: file publish + reload against the in-memory sync.

A ~100 M-parameter Qwen3-architecture model (16 layers, hidden 768, float32: ~400 MB) is built on the fly; the
"trainer" is this process holding the policy as Hugging Face tensors on the CPU (what hf_convert.gather_hf_state
gives trainer rank 0; the gather is the same for both paths and not timed). Each round changes the weights, then:

  files   write the policy as safetensors into RUN/policy/v-N and commit it (trainer/publish.py's layout: the
          same writer, fsync'd rename), then the engine's in-place reload from that directory
          (VLLMEngine.load_policy) and its prefix-cache reset;
  memory  offer it from a WeightServer (trainer/weight_sender.py: TCPStore + one gloo group per session), open a
          session as the rollout's rank 0 does and receive it in the engine's worker bucket by bucket into the
          same in-place reload (VLLMEngine.sync_policy), prefix-cache reset included.

Both are timed from "the trainer holds the new tensors" to "the engine generates with them"; the first
(warm-up) round of each is dropped, the median of the rest reported. After each load a short greedy generation's
logprobs are compared between the two paths (same weights: same numbers). Files are read back from the page
cache here (one host, no Lustre): the file path's best case.

    python bench/weight_sync.py [--rounds R] [--bucket-mb B] [--dir DIR | --keep] [--quick]

The model and run directory go into a scratch directory under $TMPDIR, removed at the end (also on failure or
interruption; ~800 MB at full size); --keep keeps it and prints its path on stderr, --dir DIR writes into DIR
and leaves it. The engine's own scratch (vLLM's IPC sockets, torch's kernel cache) is removed at its shutdown.

--quick: a 4-layer, hidden-256 model (a smoke test; its ratio says little). The last stdout line is one JSON
object: both times, `speedup` (files / memory), the model's size; exit status 1 when the logprobs disagree.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path


def build_model(root: Path, quick: bool) -> Path:
    from rstar_hpc.config.run import TinyModelSpec
    from rstar_hpc.models.tiny import make_tiny_model

    spec = (TinyModelSpec(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                          intermediate_size=512) if quick else
            TinyModelSpec(num_layers=16, hidden_size=768, num_heads=12, num_kv_heads=4, head_dim=64,
                          intermediate_size=2048))
    return make_tiny_model(root / ("model-quick" if quick else "model-100m"), spec)


def publish_files(paths, state: dict, model_dir: Path, version: int) -> Path:
    """What publish_policy does on rank 0 once the tensors are gathered: safetensors (5 GB shards), config and
    tokenizer files, COMMITTED.json, `latest`, retention."""
    import shutil

    from rstar_hpc.trainer.hf_convert import AUX_FILES, _write_safetensors

    dirs = paths.policies()
    tmp = dirs.begin(version)
    _write_safetensors(state, tmp, 5 * 2**30, "model")
    for name in ("config.json", *AUX_FILES):
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, tmp / name)
    for f in tmp.iterdir():   # what reaches the engines must be on storage, not in this host's cache only
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    out = dirs.commit(version, tmp, format="hf-safetensors", stage="bench", trainer_step=version)
    dirs.retain(1)
    return out


async def run(args) -> dict:
    from rstar_hpc.scratch import scratch_dir

    with contextlib.ExitStack() as stack:
        root = Path(args.dir) if args.dir else stack.enter_context(scratch_dir("bench-wsync-", keep=args.keep))
        return await _run(args, root)


async def _run(args, root: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    from rstar_hpc.config import load_config
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.exchange.weight_protocol import read_offer
    from rstar_hpc.rollout.engine import VLLMEngine
    from rstar_hpc.rollout.weight_receiver import open_session
    from rstar_hpc.trainer.weight_sender import WeightServer

    model_dir = build_model(root, args.quick)
    state = load_file(str(model_dir / "model.safetensors"))
    params = sum(t.numel() for t in state.values())
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    paths = RunPaths(root / "run")
    paths.create()
    cfg = load_config("tiny-cpu", ["rollout.engine.kv_cache_memory_mb=96"])
    engine = VLLMEngine(cfg.rollout, model_dir, seed=0)
    server = WeightServer(paths.dir, timeout_s=120, bucket_bytes=args.bucket_mb << 20, host="127.0.0.1")
    prompt = engine.tokenizer.encode("Compute 12 * 34.")
    times: dict[str, list[float]] = {"files": [], "memory": []}
    worst = 0.0
    try:
        version = 0
        for r in range(args.rounds + 1):
            gen = torch.Generator().manual_seed(r)
            for t in state.values():   # a training step's worth of change, every tensor
                t.add_(1e-3 * torch.randn(t.shape, generator=gen, dtype=t.dtype))
            lps = {}
            for how in ("files", "memory"):
                version += 1
                t0 = time.perf_counter()
                if how == "files":
                    out = publish_files(paths, state, model_dir, version)
                    await engine.load_policy(out, version)
                else:
                    server.offer(version, "bench", version, state)
                    session = open_session(read_offer(paths.dir), version, receivers=1)
                    await engine.sync_policy(session, first_rank=1)
                dt = time.perf_counter() - t0
                if r > 0:
                    times[how].append(dt)
                g = await engine.generate(prompt, 8, f"check-{r}-{how}", seed=0, sampling={"temperature": 1.0})
                lps[how] = (g.token_ids, g.logprobs)
                print(f"round {r} {how:6s} {dt:6.2f}s", file=sys.stderr, flush=True)
            same_ids = lps["files"][0] == lps["memory"][0]
            worst = max(worst, max(abs(a - b) for a, b in zip(lps["files"][1], lps["memory"][1]))
                        if same_ids else float("inf"))
    finally:
        server.close()
        engine.shutdown()
    files_s, memory_s = statistics.median(times["files"]), statistics.median(times["memory"])
    return {"bench": "weight_sync", "params": params, "bytes": nbytes, "dtype": "float32", "rounds": args.rounds,
            "bucket_mb": args.bucket_mb, "files_s": round(files_s, 3), "memory_s": round(memory_s, 3),
            "speedup": round(files_s / memory_s, 2), "files_runs_s": [round(t, 3) for t in times["files"]],
            "memory_runs_s": [round(t, 3) for t in times["memory"]], "max_logprob_diff": worst,
            "quick": args.quick}


def main() -> int:
    from rstar_hpc.scratch import private_torch_cache

    private_torch_cache()   # before megatron/vLLM import torch._dynamo: its kernel cache goes at exit
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per path (after one warm-up round)")
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--dir", default=None, help="where the model and run directory go, left there (default: a "
                    "scratch directory under $TMPDIR, removed at the end)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (its path goes to stderr)")
    ap.add_argument("--quick", action="store_true", help="a small model (smoke test)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    result = asyncio.run(run(args))
    print(json.dumps(result), flush=True)
    return 0 if result["max_logprob_diff"] < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
