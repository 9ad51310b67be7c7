"""Weights & Biases: one W&B run per role, grouped under the run name; offline by default (compute nodes have no
network): the run is written to RUN/wandb/offline-run-*/ and uploaded later with `wandb sync RUN/wandb/offline-run-*`
(the runs of one id, a requeued role's, are synced in order into the one run)."""
from __future__ import annotations

from rstar_hpc.config.tracking import WandbConfig
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.tracking.identity import run_id


class WandbTracker:
    def __init__(self, cfg: WandbConfig, paths: RunPaths, role: str, run_name: str, hparams: dict):
        import wandb

        self.run = wandb.init(
            project=cfg.project or run_name, entity=cfg.entity, group=run_name, job_type=role,
            name=f"{run_name}-{role}", id=run_id(paths, role), resume="allow", mode=cfg.mode, tags=cfg.tags,
            dir=str(paths.dir), config=hparams,
            # several roles' runs may share a process (rollout rank 0: rollout, validation, eval)
            reinit="create_new",
            # the roles print their JSON summaries to stdout; W&B must not wrap it
            settings=wandb.Settings(console="off", silent=True))
        self._stages: set[str] = set()

    def log(self, stage: str, step: int, values: dict[str, float]) -> None:
        if stage not in self._stages:   # steps restart in each stage: each stage gets its own x axis
            self.run.define_metric(f"{stage}/step", hidden=True)
            self.run.define_metric(f"{stage}/*", step_metric=f"{stage}/step")
            self._stages.add(stage)
        self.run.log({**{f"{stage}/{k}": v for k, v in values.items()}, f"{stage}/step": step})

    def close(self) -> None:
        self.run.finish()
