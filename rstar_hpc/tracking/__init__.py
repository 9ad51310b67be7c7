"""Trackers: where the metrics sink (rstar_hpc/metrics_log.py) mirrors each role's step records besides TensorBoard.

    wandb_backend.py    Weights & Biases: one W&B run per role in the group `run.name`, offline by default
    mlflow_backend.py   MLflow: one MLflow run per role in the experiment `run.name`, file store or server
    gpu.py              GPU utilisation and memory from NVML, where there is a GPU

Which trackers a role opens is read from the run directory's config.yaml (`tracking:`, config/tracking.py), so
every role and every process of a run agrees without being told. A tracker's run id is derived from the run
directory and the role (identity.py): a requeued job continues the same run. The resolved config is logged as
the run's hyperparameters. The packages are the `tracking` extra; nothing here is imported unless enabled.
"""
from __future__ import annotations

import logging

import yaml

from rstar_hpc.exchange.rundir import RunPaths

log = logging.getLogger("rstar_hpc.metrics")


def open_trackers(paths: RunPaths, role: str) -> list:
    """The trackers the run's config.yaml enables for `role`, opened; [] without a config.yaml or with none on.
    A tracker that fails to open is left out with a warning: trackers are views, the JSONL is the record."""
    from rstar_hpc.config.tracking import TrackingConfig

    try:
        hparams = yaml.safe_load(paths.config.read_text()) or {}
    except FileNotFoundError:
        return []
    cfg = TrackingConfig.model_validate(hparams.get("tracking") or {})
    run_name = (hparams.get("run") or {}).get("name") or paths.name
    out = []
    for name in cfg.enabled():
        try:
            if name == "wandb":
                from rstar_hpc.tracking.wandb_backend import WandbTracker
                out.append(WandbTracker(cfg.wandb, paths, role, run_name, hparams))
            else:
                from rstar_hpc.tracking.mlflow_backend import MlflowTracker
                out.append(MlflowTracker(cfg.mlflow, paths, role, run_name, hparams))
        except Exception as e:   # noqa: BLE001  (a view must never stop a role)
            log.warning("%s tracking off for %s: %s: %s (metrics/%s.jsonl is unaffected)", name, role,
                        type(e).__name__, e, role)
    return out


def gpu_enabled(paths: RunPaths) -> bool:
    try:
        tracking = (yaml.safe_load(paths.config.read_text()) or {}).get("tracking") or {}
    except FileNotFoundError:
        return True
    return bool(tracking.get("gpu", True))
