"""The metrics sink's trackers in their offline/file modes, read back: W&B offline run files (wandb_offline.py)
and MLflow's client API over a file store. A second sink for the same role (a requeued job) continues the same
W&B id and the same MLflow run; the resolved config is each run's hyperparameters."""
from __future__ import annotations

import time

import pytest
import yaml

from rstar_hpc.config import ConfigError, load_config
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.metrics_log import MetricsSink
from rstar_hpc.tracking.identity import run_id

pytest.importorskip("wandb", reason="the tracking extra: pip install -e '.[tracking]'")
pytest.importorskip("mlflow", reason="the tracking extra: pip install -e '.[tracking]'")

from tests.helpers import wandb_offline  # noqa: E402


def _run_dir(tmp_path, **tracking) -> RunPaths:
    paths = RunPaths(tmp_path / "runs" / "trk")
    paths.create(stripe=False)
    cfg = {"run": {"name": "trk", "seed": 3}, "trainer": {"optimizer": {"lr": 0.001}}, "tracking": tracking}
    paths.config.write_text(yaml.safe_dump(cfg))
    return paths


def _job(paths: RunPaths, records: list[dict]) -> None:
    """One job of the trainer role: its own sink, closed at its end (what atexit does)."""
    sink = MetricsSink(paths, "trainer", tensorboard=False)
    for r in records:
        sink.write(r)
    sink.write({"stage": "rl", "benchmark": "b", "pass1": 0.25}, step=records[-1]["step"], group="b")
    sink.close()


def test_wandb_offline_and_mlflow_file_store_hold_every_step_across_a_requeue(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_SILENT", "true")
    paths = _run_dir(tmp_path, wandb={"enabled": True, "project": "p"}, mlflow={"enabled": True}, gpu=False)
    _job(paths, [{"stage": "rl", "step": 0, "loss": 0.5, "time/step(s)": 2.0},
                 {"stage": "rl", "step": 1, "loss": 0.25, "time/step(s)": 1.0}])
    # W&B names an offline run's folder by the second it started; a requeued job starts in a later one
    time.sleep(1.05 - time.time() % 1)
    _job(paths, [{"stage": "rl", "step": 2, "loss": 0.125, "time/step(s)": 1.5}])   # the requeued job

    key = run_id(paths, "trainer")
    files = wandb_offline.run_files(paths.dir, key)
    assert len(files) == 2, "each job writes its own offline file of the one W&B run id"
    # W&B's service process writes the file; on a loaded machine its last records can land just after finish()
    deadline = time.monotonic() + 30
    while True:
        rows = [r for f in files for r in wandb_offline.history(f)]
        steps = [(r["rl/step"], r["rl/trainer/loss"]) for r in rows if "rl/trainer/loss" in r]
        if len(steps) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert steps == [(0, 0.5), (1, 0.25), (2, 0.125)]
    assert [r["rl/trainer/b/pass1"] for r in rows if "rl/trainer/b/pass1" in r] == [0.25, 0.25]
    assert any(r.get("rl/trainer/time/step_s") == 1.5 for r in rows)
    hp = wandb_offline.config(files[0])
    assert hp["run"] == {"name": "trk", "seed": 3} and hp["trainer"]["optimizer"]["lr"] == 0.001

    client = MlflowClient(tracking_uri=f"file:{paths.dir / 'mlruns'}")
    exp = client.get_experiment_by_name("trk")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, "the requeued job continues the role's MLflow run"
    run = runs[0]
    assert run.data.tags["rstar.run_id"] == key and run.data.tags["rstar.role"] == "trainer"
    history = client.get_metric_history(run.info.run_id, "rl/trainer/loss")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.5), (1, 0.25), (2, 0.125)]
    assert run.data.params["trainer.optimizer.lr"] == "0.001" and run.data.params["run.seed"] == "3"


def test_a_role_starting_while_another_writes_its_first_metric_gets_its_mlflow_run(tmp_path):
    """MLflow's file store, searched while another role has just created a metric file and not yet written its line
    ("Metric ... is malformed. No data found"), as the trainer and the rollout's validation did in a CI run: the new
    role reads again and gets its run instead of turning MLflow off."""
    import threading

    from mlflow.tracking import MlflowClient

    from rstar_hpc.config.tracking import MlflowConfig
    from rstar_hpc.tracking.mlflow_backend import MlflowTracker

    paths = _run_dir(tmp_path, mlflow={"enabled": True})
    trainer = MlflowTracker(MlflowConfig(enabled=True), paths, "trainer", "trk", {})
    run_dir = next((paths.dir / "mlruns").glob(f"*/{trainer.run_id}"))
    half = run_dir / "metrics" / "rl" / "trainer" / "response" / "truncated_frac"
    half.parent.mkdir(parents=True, exist_ok=True)
    half.write_text("")   # created, its first line not yet written
    with pytest.raises(ValueError, match="malformed"):   # what the search met
        MlflowClient(tracking_uri=f"file:{paths.dir / 'mlruns'}").search_runs([trainer.experiment_id])
    threading.Timer(0.5, lambda: half.write_text(f"{int(time.time() * 1000)} 0.25 1\n")).start()
    validation = MlflowTracker(MlflowConfig(enabled=True), paths, "validation", "trk", {})
    assert validation.run_id != trainer.run_id
    runs = MlflowClient(tracking_uri=f"file:{paths.dir / 'mlruns'}").search_runs([trainer.experiment_id])
    assert sorted(r.data.tags["rstar.role"] for r in runs) == ["trainer", "validation"]


def test_each_role_its_own_run_id_in_one_group(tmp_path):
    paths = RunPaths(tmp_path / "r")
    assert run_id(paths, "trainer") != run_id(paths, "rollout")
    assert run_id(paths, "trainer") == run_id(RunPaths(tmp_path / "r"), "trainer")
    assert run_id(paths, "trainer") != run_id(RunPaths(tmp_path / "other"), "trainer")


def test_no_tracker_without_a_config_or_with_all_off(tmp_path):
    paths = _run_dir(tmp_path)
    sink = MetricsSink(paths, "trainer", tensorboard=False)
    sink.write({"stage": "rl", "step": 0, "loss": 1.0})
    assert sink._trackers == [] and not (paths.dir / "wandb").exists() and not (paths.dir / "mlruns").exists()


def test_a_backend_on_but_not_installed_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = load_config("tiny-cpu", ["tracking.wandb.enabled=true"])
    with pytest.raises(ValueError, match=r"tracking.wandb.enabled is on but wandb is not installed.*\.\[tracking\]"):
        cfg.tracking.check_installed()


@pytest.mark.parametrize("overrides, message", [
    (["stages.rl-short.val_every=2"], r"val_every=2 needs the held-out problems: set stages\[rl-short\].val_data"),
    (["stages.rl-short.val_data=demo"], r"val_data is set but val_every is not"),
    (["tracking.wandb.mode=cloud"], r"tracking.wandb.mode"),
])
def test_bad_tracking_and_validation_config_is_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny-cpu", overrides)


def test_validation_stage_name_is_kept_free():
    with pytest.raises(ConfigError, match="'rl-short-val' is where stage 'rl-short' keeps its validation"):
        load_config("tiny-cpu", ["stages.rl-short.val_every=1", "stages.rl-short.val_data=demo",
                                 "stages.eval.name=rl-short-val"])


def test_gpu_figures_reach_the_views_and_cpu_nodes_log_none(tmp_path, monkeypatch):
    """No GPU here: NVML's answers are played by a stand-in module (nvidia-ml-py's API names and shapes), which
    is what a GPU node's pynvml returns; on this CPU machine the real lookup gives nothing."""
    import types

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rstar_hpc.tracking import gpu

    gpu._nvml.cache_clear()
    assert gpu.gpu_figures() == {} or gpu._nvml() is not None   # a CPU node: nothing, silently
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 1, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=2 * 2**30, total=8 * 2**30),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=75))
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
    gpu._nvml.cache_clear()
    try:
        assert gpu.gpu_figures() == {"gpu0/util_pct": 75.0, "gpu0/mem_used(GiB)": 2.0, "gpu0/mem_pct": 25.0}
        paths = _run_dir(tmp_path)
        sink = MetricsSink(paths, "rollout")
        sink.write({"stage": "rl", "step": 4, "mean_reward": 0.5})
        sink.write({"stage": "rl", "benchmark": "b", "pass1": 0.5}, step=4, group="b")   # no GPU figures twice
        sink.close()
        tb = EventAccumulator(str(paths.tb_dir("rl")))
        tb.Reload()
        assert [(e.step, e.value) for e in tb.Scalars("rollout/gpu0/util_pct")] == [(4, 75.0)]
        assert not any(t.startswith("rollout/b/gpu") for t in tb.Tags()["scalars"])
        assert "gpu0" not in paths.metrics("rollout").read_text(), "the JSONL is the record as written"
    finally:
        gpu._nvml.cache_clear()
