"""MLflow: one MLflow run per role in the experiment named after the run, against a server or a file store.
A requeued role finds its run again by the tag `rstar.run_id` (identity.run_id) and logs on into it."""
from __future__ import annotations

import os
import time

from rstar_hpc.config.tracking import MlflowConfig
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.tracking.identity import flat_params, run_id

KEY_TAG = "rstar.run_id"
BATCH = 100   # MLflow's limit of params per log_batch
READ_TRIES, READ_PAUSE_S = 10, 0.2


def _read_again(call):
    """A file-store read that met another role's metric file half-written: MLflow's search reads every run of the
    experiment, and a file another role has just created holds no line yet ("Metric 'rl/trainer/...' is malformed.
    No data found"; seen in CI with the trainer and the rollout's validation starting together). Read again."""
    for attempt in range(READ_TRIES):
        try:
            return call()
        except ValueError as e:
            if "malformed" not in str(e) or attempt == READ_TRIES - 1:
                raise
            time.sleep(READ_PAUSE_S)


def tracking_uri(cfg: MlflowConfig, paths: RunPaths) -> str:
    return cfg.tracking_uri or f"file:{paths.dir.absolute() / 'mlruns'}"


class MlflowTracker:
    def __init__(self, cfg: MlflowConfig, paths: RunPaths, role: str, run_name: str, hparams: dict):
        uri = tracking_uri(cfg, paths)
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 refuses the file store unless asked; it is what works on shared storage without a server
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.experiment_id = self._experiment(cfg.experiment or run_name)
        key = run_id(paths, role)
        found = _read_again(lambda: self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`{KEY_TAG}` = '{key}'", max_results=1))
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            logged = found[0].data.params
        else:
            run = self.client.create_run(self.experiment_id, run_name=f"{run_name}-{role}",
                                         tags={KEY_TAG: key, "rstar.role": role, "rstar.run": run_name})
            self.run_id, logged = run.info.run_id, {}
        self._log_params({k: v for k, v in flat_params(hparams).items() if k not in logged})

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except Exception:   # another role created it meanwhile
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + BATCH])

    def log(self, stage: str, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(f"{stage}/{k}", v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):   # MLflow's limit of metrics per log_batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
