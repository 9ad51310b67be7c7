"""Validation inside an rl stage (`stages[].val_every: N`, `val_data`): the policy of step 0, N, 2N, ... and the
stage's final policy (pipeline.val_points), scored avg@k pass@1 on held-out files by the rollout job.

Why the rollout job, right after committing step p: its engines already hold the policy step p ran
(pipeline.val_need), so the pass loads nothing and overlaps the trainer's update on step p; only the final point
waits for the trainer's last policy. A pass is an ordinary rollout step of the pseudo stage `<stage>-val` at step
p (traj/<stage>-val/step-p/: the same scheduler, journal and commit), so a requeue keeps what it committed. Its
scores are the eval machinery's (rstar_hpc.eval.metrics over eval.results' trajectory rows):

    eval/<stage>/val/step-<p>.json   {"stage", "step", "k", "policy": {"version", "trainer_step"}, "benchmarks"}
    metrics/validation.jsonl         one record per benchmark: {"stage", "step": p, "benchmark", "pass1", ...}
                                     -> TensorBoard tb/<stage>/ and the trackers: validation/<benchmark>/pass1

Sampling is the eval protocol's (eval.temperature, eval.top_p; k = stages[].val_k or eval.k); the turn and
response budget are the stage's own, so the pass fits the engine the stage runs on.
"""
from __future__ import annotations

import logging

from rstar_hpc import pipeline
from rstar_hpc.config.stages import StageConfig, val_stage
from rstar_hpc.exchange.atomic import atomic_write_json
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.config.stages import StageLimits
from rstar_hpc.rollout.step import StepSpec, make_items

log = logging.getLogger("rstar_hpc.rollout")
ROLE = "validation"   # metrics/validation.jsonl


def val_prompts(cfg, stage_cfg: StageConfig) -> list[dict]:
    """Every validation problem of the stage, uids "<benchmark>/<uid>" (as an eval stage's); system turns kept
    where the stage's `keep_system` says so."""
    from rstar_hpc.data.sets import load_prompt_file

    return [dict(p, uid=f"{name}/{p['uid']}") for name, data in stage_cfg.val_files().items()
            for p in load_prompt_file(data, cfg.run.seed, keep_system=stage_cfg.keep_system)[:stage_cfg.val_max_prompts]]


def val_limits(cfg, stage_cfg: StageConfig) -> StageLimits:
    agent = cfg.stage_limits(stage_cfg)
    return agent._replace(temperature=cfg.eval.temperature, top_p=cfg.eval.top_p)


def due(cfg, paths: RunPaths, stage_cfg: StageConfig, upto: int) -> list[int]:
    """Validation points <= `upto` with no scores yet."""
    return [p for p in pipeline.val_points(stage_cfg) if p <= upto and not pipeline.val_done(paths, stage_cfg, p)]


def validate_due(cfg, paths: RunPaths, stage_name: str, upto: int, tokenizer, run_step) -> None:
    """Every validation point of the stage up to step `upto` not scored yet (the ones a requeue left behind too)."""
    stage = cfg.stage(stage_name)
    for point in due(cfg, paths, stage, upto):
        validate(cfg, paths, stage, point, tokenizer, run_step)


def validate(cfg, paths: RunPaths, stage_cfg: StageConfig, point: int, tokenizer, run_step) -> dict:
    """Score point `point`: `run_step(spec)` runs one rollout step (a StepSpec, through the job's StepScheduler) and
    returns its summary. Returns the results written."""
    k = stage_cfg.val_k or cfg.eval.k
    items, dropped = make_items(val_prompts(cfg, stage_cfg), tokenizer, agent=cfg.rollout.agent, samples_per_prompt=k)
    need = pipeline.val_need(cfg, stage_cfg, point)
    run_step(StepSpec(val_stage(stage_cfg.name), point, items, val_limits(cfg, stage_cfg), need, dropped))
    return write_scores(paths, stage_cfg, point, k, need)


def write_scores(paths: RunPaths, stage_cfg: StageConfig, point: int, k: int, need: pipeline.PolicyNeed) -> dict:
    """The committed pass's scores: metrics first, the results file last (it marks the point done: a requeue
    between the two writes the metrics again, and readers keep a step's last record)."""
    from rstar_hpc.eval.metrics import benchmark_metrics
    from rstar_hpc.eval.results import collect
    from rstar_hpc.metrics_log import metrics_sink

    rows, versions = collect(paths, val_stage(stage_cfg.name), [point])
    version = max(versions) if need.stage is not None and versions else None
    try:
        trainer_step = paths.policies().marker(version).get("trainer_step") if version is not None else 0
    except FileNotFoundError:   # retention removed it since: the step it was asked for at least
        trainer_step = need.trainer_step
    results = {"stage": stage_cfg.name, "step": point, "k": k,
               "policy": {"version": version, "trainer_step": trainer_step},
               "benchmarks": {name: benchmark_metrics(r) for name, r in sorted(rows.items())}}
    sink = metrics_sink(paths, ROLE)
    for name, m in results["benchmarks"].items():
        sink.write({"stage": stage_cfg.name, "step": point, "benchmark": name, "policy_version": version,
                    "trainer_step": trainer_step, **{key: v for key, v in m.items() if not isinstance(v, dict)}},
                   group=name)
    path = paths.val_results(stage_cfg.name, point)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, results)
    log.info("validation of stage %s at step %d: %s", stage_cfg.name, point, "; ".join(
        f"{name} pass@1 {m['pass1']:.3f} ± {m['pass1_stderr']:.3f}" for name, m in results["benchmarks"].items()))
    return results
