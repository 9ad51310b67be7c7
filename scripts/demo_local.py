"""Run a config's whole pipeline on this machine without Slurm: the three roles as local processes, as
tests/integration/test_rl_loop.py starts them (sandbox service, `rstar-hpc train --follow`, `rstar-hpc rollout`
walking every rollout stage under mpirun), then print what the run measured.

    python scripts/demo_local.py configs/demo.yaml run.seed=1
    python scripts/demo_local.py configs/demo.yaml run.seed=1 --ablation   # plain GRPO: algo.roc off, no evals

`--ablation` runs the same SFT and RL stages (same seed, so the same SFT policy) with RoC's down-sampling off,
and skips hard_subset/eval stages after the first RL stage; compare the kept positives' p_err with the RoC run's.
The last stdout line is one JSON object with the eval figures (pass@1 and its standard error per eval stage),
the mean p_err of the kept and of all positives over the RL steps, and the wall time.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def _ablation_config(path: Path, out: Path) -> Path:
    """The config with RoC off and only the stages up to the last plain rl stage (no hard subset, no eval)."""
    cfg = yaml.safe_load(path.read_text())
    cfg["run"]["name"] = cfg["run"].get("name", "run") + "-grpo"
    cfg["algo"].setdefault("roc", {})["do_down_sampling"] = False
    stages = []
    for s in cfg["stages"]:
        if s["kind"] == "hard_subset":
            break
        if s["kind"] != "eval":
            stages.append(s)
    cfg["stages"] = stages
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def run_roles(config: str, overrides: list[str], logs: Path, engines: int, timeout_s: float) -> None:
    from rstar_hpc.config import load_config

    cfg = load_config(config, overrides)
    run = cfg.run.dir
    logs.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "rstar_hpc"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "MASTER_PORT": str(_free_port())}   # not the trainer's default: runs share hosts
    files = {n: open(logs / f"{n}.log", "w") for n in ("sandbox", "trainer", "rollout")}  # noqa: SIM115
    procs = {"sandbox": subprocess.Popen([*cli, "sandbox", "serve", "--workers", str(cfg.sandbox.num_workers),
                                          "--run-dir", str(run), "--host", "127.0.0.1"], cwd=REPO, env=env,
                                         stdout=files["sandbox"], stderr=subprocess.STDOUT)}
    try:
        procs["trainer"] = subprocess.Popen([*cli, "train", config, *overrides, "--follow"], cwd=REPO, env=env,
                                            stdout=files["trainer"], stderr=subprocess.STDOUT)
        rollout_stages = [s for s in cfg.stages if s.kind != "sft"]
        if rollout_stages:
            procs["rollout"] = subprocess.Popen([*cli, "rollout", "--config", config, "--engines", str(engines),
                                                 *overrides], cwd=REPO, env=env, stdout=files["rollout"],
                                                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        for name in ("rollout", "trainer"):
            if name not in procs:
                continue
            rc = procs[name].wait(timeout=max(1.0, deadline - time.monotonic()))
            if rc:
                raise SystemExit(f"{name} exited {rc}; see {logs / (name + '.log')}")
    finally:
        for p in procs.values():
            _stop(p)
        for f in files.values():
            f.close()


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else None


def _pass1_by_level(cfg, stage) -> dict:
    """pass@1 per demo level (rstar_hpc.demo_task) from the eval stage's trajectories."""
    from collections import defaultdict

    from rstar_hpc import pipeline
    from rstar_hpc.demo_task import level_of
    from rstar_hpc.eval.results import collect
    from rstar_hpc.exchange.rundir import RunPaths

    rows, _ = collect(RunPaths(cfg.run.dir), stage.name,
                      pipeline.rollout_steps(stage, len(pipeline.stage_prompts(cfg, stage))))
    by = defaultdict(list)
    for bench_rows in rows.values():
        for r in bench_rows:
            by[level_of(r["prompt_uid"])].append(r["reward"] > 0)
    return {f"L{k}": round(sum(v) / len(v), 3) for k, v in sorted(by.items(), key=lambda kv: str(kv[0]))}


def summarize(config: str, overrides: list[str]) -> dict:
    from rstar_hpc.config import load_config

    cfg = load_config(config, overrides)
    run = cfg.run.dir
    out: dict = {"run": str(run)}
    for s in cfg.stages:
        if s.kind == "eval" and (run / "eval" / s.name / "results.json").is_file():
            res = json.loads((run / "eval" / s.name / "results.json").read_text())
            for bench, m in res["benchmarks"].items():
                out[f"{s.name}/{bench}"] = {k: m.get(k) for k in ("pass1", "pass1_stderr", "problems",
                                                                  "tool_calls_per_trajectory", "tool_error_ratio")}
            out[f"{s.name}/pass1_by_level"] = _pass1_by_level(cfg, s)
    rows = []
    metrics = run / "metrics" / "trainer.jsonl"
    if metrics.is_file():
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    for stage in [s.name for s in cfg.stages if s.kind == "rl"]:
        rl = [r for r in rows if r.get("stage") == stage]
        out[f"{stage}/steps"] = len(rl)
        for key in ("reward/mean", "roc/p_err_kept_pos", "roc/p_err_all_pos", "roc/pass_rate_before"):
            out[f"{stage}/{key}"] = [round(r[key], 3) if r.get(key) is not None else None for r in rl]
    rl_rows = [r for r in rows if r.get("stage") in {s.name for s in cfg.stages if s.kind == "rl"}]
    out["p_err_kept_pos_mean"] = _mean([r.get("roc/p_err_kept_pos") for r in rl_rows])
    out["p_err_all_pos_mean"] = _mean([r.get("roc/p_err_all_pos") for r in rl_rows])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--ablation", action="store_true", help="plain GRPO: RoC off, stages up to the last rl stage")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=1800)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # so run_roles' finally stops the roles
    config = str(Path(a.config).absolute())
    if a.ablation:
        import tempfile
        config = str(_ablation_config(Path(config), Path(tempfile.mkdtemp()) / (Path(config).stem + ".grpo.yaml")))
        # a run.name override would put the ablation in the RoC run's directory
        a.overrides = [o + "-grpo" if o.startswith("run.name=") else o for o in a.overrides]
    from rstar_hpc.config import load_config
    from rstar_hpc.models.resolve import resolve_model
    t0 = time.perf_counter()
    cfg = load_config(config, a.overrides)
    resolve_model(cfg)   # build a tiny model once, before two roles race to build it
    run = cfg.run.dir
    run_roles(config, a.overrides, run / "local-logs", a.engines, a.timeout_s)
    out = summarize(config, a.overrides)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
