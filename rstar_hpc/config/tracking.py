"""Where a run's metrics go besides metrics/<role>.jsonl and TensorBoard (rstar_hpc/tracking/): Weights & Biases
and MLflow, both off by default and both in the `tracking` pip extra (`pip install -e '.[tracking]'`).

Every role logs under one name, the run's (`run.name`): a W&B group with one W&B run per role, an MLflow
experiment with one MLflow run per role. A requeued job continues its role's run instead of starting a new one.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from rstar_hpc.config.base import Section

EXTRA = "pip install -e '.[tracking]'"   # the fix named when a backend is on but not installed


class WandbConfig(Section):
    enabled: bool = False
    project: str | None = None
    """W&B project; null: the run name."""
    entity: str | None = None
    """W&B team or user; null: the default of the logged-in account (or of `wandb sync` later)."""
    mode: Literal["offline", "online"] = "offline"
    """offline: written under RUN/wandb/ with no network (compute nodes), uploaded later with `wandb sync
    RUN/wandb/offline-run-*`; online: streamed to the server (needs network and `wandb login` on every node)."""
    tags: list[str] = Field(default_factory=list)


class MlflowConfig(Section):
    enabled: bool = False
    tracking_uri: str | None = None
    """A server (`http://host:5000`) or a file store (`file:/path/mlruns`); null: `file:RUN/mlruns`."""
    experiment: str | None = None
    """MLflow experiment; null: the run name."""


class TrackingConfig(Section):
    wandb: WandbConfig = WandbConfig()
    mlflow: MlflowConfig = MlflowConfig()
    gpu: bool = True
    """Log GPU utilisation and memory with each role's step record where NVML finds a GPU (nvidia-ml-py, in the
    tracking extra); nothing on CPU nodes."""

    def enabled(self) -> list[str]:
        return [name for name in ("wandb", "mlflow") if getattr(self, name).enabled]

    def missing_packages(self) -> list[str]:
        """The enabled backends whose package this Python cannot import."""
        from importlib.util import find_spec

        module = {"wandb": "wandb", "mlflow": "mlflow"}
        return [name for name in self.enabled() if find_spec(module[name]) is None]

    def check_installed(self) -> None:
        missing = self.missing_packages()
        if missing:
            keys = ", ".join(f"tracking.{m}.enabled" for m in missing)
            raise ValueError(f"{keys} is on but {' and '.join(missing)} is not installed in this Python: "
                             f"install the tracking extra ({EXTRA}), or set {keys}=false")
