"""Where each role runs: Slurm partitions, node counts and time limits."""
from __future__ import annotations

from pydantic import Field

from rstar_hpc.config.base import Section


class RoleResources(Section):
    partition: str = "gpu"
    num_nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    cpus_per_task: int = Field(1, ge=1)
    tasks_per_node: int = Field(1, ge=1)
    time_min: int = Field(60, ge=1)
    """Slurm time limit; jobs checkpoint on the pre-timeout signal and are requeued."""


class LaunchConfig(Section):
    trainer: RoleResources = RoleResources(partition="gpu")
    rollout: RoleResources = RoleResources(partition="gpu")
    sandbox: RoleResources = RoleResources(partition="cpu")
    signal_lead_s: int = Field(90, ge=10)
    """Seconds before the time limit at which Slurm sends USR2 (save, then requeue)."""
    max_restarts: int = Field(3, ge=0)
