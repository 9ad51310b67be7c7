"""Validation inside an rl stage, without engines: which steps are validated, when the rollout's part of a stage
is done, and the scores of a committed pass (synthetic trajectories with known rewards) in results, metrics
(JSONL and TensorBoard) and `run status`."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from rstar_hpc import pipeline
from rstar_hpc.config import load_config, prepare_run_dir
from rstar_hpc.synthetic.trajectories import make_trajectory
from rstar_hpc.exchange.writer import ShardWriter
from rstar_hpc.launch.status import validation_status
from rstar_hpc.rollout import validation


@pytest.fixture
def cfg(tmp_path):
    return load_config("tiny-cpu", [f"run.root={tmp_path}", "stages.rl-short.num_steps=5",
                                    "stages.rl-short.val_every=2", "stages.rl-short.val_data=demo",
                                    "stages.rl-short.val_k=2", "tracking.gpu=false"])


def _commit_pass(paths, point: int, rewards: dict[str, list[float]]) -> None:
    rng = np.random.default_rng(point)
    trajs = [dataclasses.replace(make_trajectory(rng, "r", "rl-short-val", point, uid, i, mean_tokens=50),
                                 reward=r, policy_version=0)
             for uid, rs in rewards.items() for i, r in enumerate(rs)]
    with ShardWriter(paths, "rl-short-val", point, pipeline.PRODUCER) as w:
        w.write(trajs)


def test_points_every_n_steps_and_the_final_policy(cfg):
    stage = cfg.stage("rl-short")
    assert pipeline.val_points(stage) == [0, 2, 4, 5]
    assert pipeline.val_points(cfg.stage("rl-long")) == []
    assert pipeline.val_need(cfg, stage, 0) == pipeline.starting_policy(cfg, "rl-short")
    assert pipeline.val_need(cfg, stage, 2) == pipeline.PolicyNeed("rl-short", 2)
    assert pipeline.val_need(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={
        "scheduler": cfg.rollout.scheduler.model_copy(update={"max_policy_lag": 1})})}), stage, 5) == \
        pipeline.PolicyNeed("rl-short", 5), "the end scores the final policy whatever the lag"
    limits = validation.val_limits(cfg, stage)
    assert (limits.max_response_length, limits.temperature) == (256, cfg.eval.temperature)


def test_scores_of_a_pass_reach_results_metrics_and_status(cfg):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    paths = prepare_run_dir(cfg)
    stage = cfg.stage("rl-short")
    for step in range(stage.num_steps):   # every training step committed: only validation is left
        with ShardWriter(paths, "rl-short", step, pipeline.PRODUCER) as w:
            w.write([])
    assert not pipeline.rollout_done(cfg, paths, "rl-short")
    assert validation.due(cfg, paths, stage, 2) == [0, 2]

    _commit_pass(paths, 0, {"demo/a": [1.0, 0.0], "demo/b": [0.0, 0.0]})
    _commit_pass(paths, 2, {"demo/a": [1.0, 1.0], "demo/b": [1.0, 0.0]})
    for point in (0, 2):
        validation.write_scores(paths, stage, point, 2, pipeline.PolicyNeed(None))
    assert validation.due(cfg, paths, stage, 5) == [4, 5]
    saved = json.loads(paths.val_results("rl-short", 2).read_text())
    assert saved["benchmarks"]["demo"]["pass1"] == 0.75 and saved["benchmarks"]["demo"]["problems"] == 2

    records = [json.loads(x) for x in paths.metrics("validation").read_text().splitlines()]
    assert [(r["step"], r["benchmark"], r["pass1"]) for r in records] == [(0, "demo", 0.25), (2, "demo", 0.75)]
    tb = EventAccumulator(str(paths.tb_dir("rl-short")))
    tb.Reload()
    assert [(e.step, e.value) for e in tb.Scalars("validation/demo/pass1")] == [(0, 0.25), (2, 0.75)]

    status = validation_status(paths, "rl-short")
    assert status["val_step"] == 2 and status["pass1"]["demo"]["pass1"] == 0.75
    assert [v["step"] for v in status["validation"]] == [0, 2]

    for point in (4, 5):
        _commit_pass(paths, point, {"demo/a": [1.0, 1.0]})
        validation.write_scores(paths, stage, point, 2, pipeline.PolicyNeed(None))
    assert pipeline.rollout_done(cfg, paths, "rl-short")

    from rstar_hpc.metrics_log import metrics_sink
    from rstar_hpc.report.build import build_report
    metrics_sink(paths, "rollout").write({"stage": "rl-short", "step": 0, "mean_reward": 0.5})
    report = build_report(paths, out=paths.dir / "report")
    md = report.markdown.read_text()
    assert "Validation during RL" in md and "| rl-short | 2 | demo | 0.750 |" in md
    assert (paths.dir / "report" / "validation.png").is_file()
