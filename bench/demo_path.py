"""The demo's path, short: `rstar-hpc demo` (configs/demo.yaml) with fewer steps and problems, through the local
Slurm cluster, and where its time went beside the work its roles did, measured in the same run.

    python bench/demo_path.py [--sft-steps 60] [--rl-steps 2] [--eval-prompts 32] [--modes RoC] [--keep]

Per run (the SFT run, each RL run): its wall seconds by phase (report/phases.py: the job's start, each stage from
the previous stage's end, the end), and the baseline: the seconds its roles computed, from their own metrics (the
trainer's `time/train(s)` and checkpoint, the rollout's generation wall per step). `overhead_ratio` = wall / work:
what the path adds around the work (Slurm and role start-up, vLLM's engine start and warm-up, the waits between
the trainer and the rollout, commits). A slower start, a longer poll or a new wait raises it while the work stays;
a slower kernel raises the work seconds, which bench/trainer.py compares with plain PyTorch. On the 2-core machine
(2026-11-28, defaults): the SFT run 67.4 s for 41.3 s of work (1.63), the RL run 53.0 s for 23.3 s (2.27), of which
~20 s is vLLM's engine start; docs/demo-measurements.md has what each change of that day cost the whole demo.

--quick: the CI-sized demo of tests/integration/test_demo.py (30 SFT steps, one step a RL stage), RoC only.
The cluster is the demo's: one that is up is used, else the demo starts one and stops it (--state-dir: a cluster
of its own). The last stdout line is one JSON object of the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _records(path: Path) -> list[dict]:
    from rstar_hpc.report.records import iter_records

    return list(iter_records(path)) if path.is_file() else []


def run_work(run_dir: Path) -> dict:
    """The seconds a run's roles computed: the trainer's steps (train, publish and checkpoint: not its waits for
    trajectories) and the rollout's generation (each step's wall from its first admission to its last result)."""
    trainer = _records(run_dir / "metrics" / "trainer.jsonl")
    rollout = _records(run_dir / "metrics" / "rollout.jsonl")
    t = sum(float(r.get(k) or 0.0) for r in trainer for k in ("time/train(s)", "time/publish(s)",
                                                               "time/checkpoint(s)"))
    g = sum(float(r.get("generation_wall_s") or 0.0) for r in rollout)
    return {"trainer_s": round(t, 1), "rollout_s": round(g, 1), "work_s": round(t + g, 1),
            "trainer_steps": len(trainer), "rollout_steps": len(rollout)}


def figures(summary: dict) -> dict:
    """From the demo's JSON line: per run its phases, its work and wall / work."""
    from rstar_hpc.cli.demo import MODES

    phases = summary["phases"]
    runs = {"sft": (phases["sft_run"], summary["runs"]["SFT"])}
    label_of = {key: label for label, (key, _) in MODES.items()}
    for key, ph in phases.get("rl_runs", {}).items():
        runs[key] = (ph, summary["runs"][label_of[key]])
    out = {}
    for key, (ph, run_dir) in runs.items():
        work = run_work(Path(run_dir))
        ratio = round(ph["wall"] / work["work_s"], 2) if work["work_s"] else None
        out[key] = {"wall_s": ph["wall"], "phases": {k: v for k, v in ph.items() if k != "wall"}, **work,
                    "overhead_ratio": ratio}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--rl-steps", type=int, default=2, help="steps of each rl stage (rl-short, rl, rl-hard)")
    ap.add_argument("--eval-prompts", type=int, default=32, help="problems of each eval and of the hard subset")
    ap.add_argument("--modes", default="RoC", help="RL runs (rstar-hpc demo --modes)")
    ap.add_argument("--state-dir", default=None, help="local cluster state directory (default: the demo's)")
    ap.add_argument("--quick", action="store_true", help="test_demo's size: 30 SFT steps, 1 step an RL stage, 16 "
                    "problems an eval")
    ap.add_argument("--keep", action="store_true", help="keep the run directories (their path goes to stderr)")
    args = ap.parse_args()
    if args.quick:
        args.sft_steps, args.rl_steps, args.eval_prompts = 30, 1, 16
    from rstar_hpc.scratch import scratch_dir

    n = args.eval_prompts
    overrides = [f"stages.sft.num_steps={args.sft_steps}", f"stages.rl-short.num_steps={args.rl_steps}",
                 f"stages.rl.num_steps={args.rl_steps}", f"stages.rl-hard.num_steps={args.rl_steps}",
                 f"stages.eval-base.max_prompts={n}", f"stages.eval-sft.max_prompts={n}",
                 f"stages.eval.max_prompts={n}", f"stages.hard.max_prompts={n}", "eval.k=2"]
    with scratch_dir("bench-demo-", keep=args.keep) as scratch:
        cmd = [sys.executable, "-m", "rstar_hpc", "demo", "demo", f"run.root={scratch}", *overrides,
               "--modes", args.modes, "--timeout-s", "1200"]
        if args.state_dir:
            cmd += ["--state-dir", args.state_dir]
        t0 = time.monotonic()
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=os.environ.copy())
        wall = time.monotonic() - t0
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-5000:])
            raise SystemExit(f"bench/demo_path.py: the demo failed (exit {done.returncode})")
        sys.stderr.write("\n".join(line for line in done.stderr.splitlines() if "|" in line or "by phase" in line)
                         + "\n")
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        runs = figures(summary)
    for key, r in runs.items():
        print(f"{key:6s} wall {r['wall_s']:7.1f} s   work {r['work_s']:7.1f} s (trainer {r['trainer_s']:.1f}, "
              f"rollout {r['rollout_s']:.1f})   wall/work {r['overhead_ratio']}", flush=True)
    print(json.dumps({"bench": "demo_path", "sft_steps": args.sft_steps, "rl_steps": args.rl_steps,
                      "eval_prompts": n, "wall_s": round(wall, 1),
                      "demo_phases": {k: v for k, v in summary["phases"].items()
                                      if k not in ("sft_run", "rl_runs")},
                      "runs": runs}, separators=(",", ":")))


if __name__ == "__main__":
    main()
