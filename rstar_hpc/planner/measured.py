"""A finished run's own rates and step times, from RUN/metrics/trainer.jsonl and rollout.jsonl (`--from-run`).

Measured, per run (pooled over its rl steps, so each rate is one number however many stages there are):
  decode_tok_s    one engine's generated tokens (trajectories x the step's mean response length, the trainer's
                  `response/length_mean(tokens)` of the step it trained) per second of the rollout's generation
                  wall (`generation_wall_s`: the engines' policy load, decoding, tools and the long tail)
  train_flops     model FLOPs of the tokens the trainer processed (tokens_per_s x step_time_s; rl steps with 4
                  passes over time/train(s), sft steps 3 over step_time_s) per second, per trainer device
  sync_gbs        the bf16 policy's bytes / the mean time/publish(s)
  ckpt_gbs        14 bytes per parameter / the mean time/checkpoint(s) of the steps that saved (with async saves,
                  time/checkpoint_async(s): the whole write, not the part the loop blocked on)
  kept_fraction   trajectories RoC kept / prompts_per_step x G
  tool_calls_per_traj, tool_latency_s   the rollout's tool calls per trajectory and tool wait per call
  response_tokens each rl stage's mean response length
  handover_s      on-policy runs: the trainer's read wait of step s+1 (time/read(s)) beyond the rollout's
                  generation wall of step s: the commit, the trainer's poll, reading and checking the shards
The measured step time of the run is the mean of the trainer's time/step(s) over its rl steps (as `run status`
shows it per stage): reading (waiting for the rollout), training, publishing, checkpointing.
"""
from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

from rstar_hpc.metrics_log import read_records
from rstar_hpc.planner.model import CKPT_BYTES_PER_PARAM, PlanError, devices_per_node, shape_of
from rstar_hpc.planner.rates import Rates
from rstar_hpc.trainer.flops import model_flops


def _last_by_step(records: list[dict]) -> dict[tuple[str, int], dict]:
    return {(r["stage"], int(r["step"])): r for r in records if "stage" in r and "step" in r}


def read_run(run_dir: Path, run_cfg) -> tuple[dict, dict]:
    """(trainer records, rollout records) of the run's rl stages by (stage, step); PlanError without RL steps."""
    rl = {s.name for s in run_cfg.stages if s.kind == "rl"}
    metrics = run_dir / "metrics"
    trainer = {k: r for k, r in _last_by_step(read_records(metrics / "trainer.jsonl")).items() if k[0] in rl}
    rollout = {k: r for k, r in _last_by_step(read_records(metrics / "rollout.jsonl")).items()
               if k[0] in rl and r.get("generation_wall_s")}
    if not trainer or not rollout:
        raise PlanError(f"{run_dir}: no RL step metrics ({metrics}/trainer.jsonl and rollout.jsonl hold no step of an "
                        f"rl stage{' (' + ', '.join(sorted(rl)) + ')' if rl else ''}); --from-run needs a run that "
                        f"trained at least one RL step: let it run, or plan without --from-run")
    return trainer, rollout


def _train_flops(run_cfg, all_trainer: dict, shape) -> float | None:
    done, seconds = 0.0, 0.0
    for (stage, _), r in all_trainer.items():
        kind = next((s.kind for s in run_cfg.stages if s.name == stage), None)
        tokens = r.get("tokens_per_s", 0) * r.get("step_time_s", 0)
        if kind == "rl" and r.get("roc/num_kept") and r.get("time/train(s)"):
            n, passes, t = int(r["roc/num_kept"]), 4, r["time/train(s)"]
        elif kind == "sft" and tokens:
            n, passes, t = run_cfg.stage(stage).prompts_per_step, 3, r["step_time_s"]
        else:
            continue
        done += model_flops(shape, [max(1, int(tokens / n))] * n, passes=passes)[0]
        seconds += t
    if not seconds:
        return None
    return done / seconds / (run_cfg.launch.trainer.num_nodes * devices_per_node(run_cfg.launch.trainer))


def run_rates(run_dir: Path, run_cfg, base: Rates) -> tuple[Rates, dict]:
    """The run's own rates on top of `base`, and its measured step seconds (overall and per rl stage)."""
    trainer, rollout = read_run(run_dir, run_cfg)
    shape, _, n_params = shape_of(run_cfg)
    tokens = wall = 0.0
    for (stage, step), r in rollout.items():
        t = trainer.get((stage, step + 1))   # the trainer's step s+1 trained the rollout's step s
        if t and t.get("response/length_mean(tokens)"):
            tokens += r["trajectories"] * t["response/length_mean(tokens)"]
            wall += r["generation_wall_s"] * max(1, len(r.get("engines") or [1]))
    if not wall:
        raise PlanError(f"{run_dir}: no rollout step of an rl stage matches a trainer step with its response length "
                        f"(metrics/rollout.jsonl step s, trainer.jsonl step s+1); let the run train an RL step")
    stages = {s.name: s for s in run_cfg.stages}
    lengths: dict[str, list[float]] = {}
    kept = wanted = 0.0
    for (stage, _), r in trainer.items():
        if "response/length_mean(tokens)" in r:
            lengths.setdefault(stage, []).append(r["response/length_mean(tokens)"])
        if "roc/num_kept" in r:
            kept += r["roc/num_kept"]
            wanted += stages[stage].prompts_per_step * run_cfg.algo.trained_per_prompt
    all_trainer = _last_by_step(read_records(run_dir / "metrics" / "trainer.jsonl"))
    publish = [r["time/publish(s)"] for r in trainer.values() if r.get("time/publish(s)")]
    # an async save's whole write (logged by the step that committed it), else what the loop blocked on
    ckpt = ([r["time/checkpoint_async(s)"] for r in trainer.values() if r.get("time/checkpoint_async(s)")]
            or [r["time/checkpoint(s)"] for r in trainer.values() if r.get("time/checkpoint(s)")])
    calls = sum(r.get("tool_calls_per_trajectory", 0) * r["trajectories"] for r in rollout.values())
    waited = sum(r.get("tool_wait_s", 0) for r in rollout.values())
    n_traj = sum(r["trajectories"] for r in rollout.values())
    rates = replace(
        base, tool_calls_per_traj=calls / n_traj if n_traj else base.tool_calls_per_traj,
        tool_latency_s=waited / calls if calls else base.tool_latency_s, decode_tok_s=tokens / wall, train_flops=_train_flops(run_cfg, all_trainer, shape),
        sync_gbs=2.0 * n_params / statistics.fmean(publish) / 1e9 if publish else base.sync_gbs,
        ckpt_gbs=CKPT_BYTES_PER_PARAM * n_params / statistics.fmean(ckpt) / 1e9 if ckpt else base.ckpt_gbs,
        kept_fraction=kept / wanted if wanted else base.kept_fraction,
        response_tokens={s: statistics.fmean(v) for s, v in lengths.items()}, source=f"run {run_dir}")
    if run_cfg.rollout.scheduler.mode == "on_policy":   # in overlap the trainer's wait is not the generation's
        over = [trainer[(st, s + 1)]["time/read(s)"] - r["generation_wall_s"] for (st, s), r in rollout.items()
                if isinstance(trainer.get((st, s + 1), {}).get("time/read(s)"), (int, float))]
        if over:
            rates = replace(rates, handover_s=max(0.0, statistics.fmean(over)))
    steps = [r["time/step(s)"] for r in trainer.values() if isinstance(r.get("time/step(s)"), (int, float))]
    by_stage = {}
    for (stage, _), r in trainer.items():
        if isinstance(r.get("time/step(s)"), (int, float)):
            by_stage.setdefault(stage, []).append(r["time/step(s)"])
    measured = {"measured_step_s": round(statistics.fmean(steps), 3) if steps else None, "measured_steps": len(steps),
                "measured_stage_step_s": {s: round(statistics.fmean(v), 3) for s, v in by_stage.items()}}
    return rates, measured
