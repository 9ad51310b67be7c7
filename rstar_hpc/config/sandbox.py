"""Knobs of the sandbox service (bubblewrap executor pools on CPU nodes)."""
from __future__ import annotations

from pydantic import Field

from rstar_hpc.config.base import Section


class SandboxConfig(Section):
    num_workers: int = Field(0, ge=0)
    """Sandboxes per service; 0 means one per core."""
    timeout_s: float = Field(4.0, gt=0, le=600)
    """Wall-time limit of one call (the paper's service used 4 s)."""
    cpu_time_s: float = Field(4.0, gt=0, le=600)
    """CPU-time limit of one call."""
    memory_mb: int = Field(1024, ge=64)
    """Address-space limit of one call."""
    max_processes: int = Field(16, ge=1)
    """Processes/threads a call may hold."""
    max_output_bytes: int = Field(8192, ge=256)
    """stdout/stderr kept per call (head and tail beyond this)."""
    session_idle_s: float = Field(600.0, gt=0)
    """A session unused this long is evicted."""
