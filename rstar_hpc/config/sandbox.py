"""Knobs of the sandbox service (bubblewrap executor pools on CPU nodes).

Mirrors `sandbox.limits.Limits` (a plain dataclass, so the service itself needs no pydantic);
`SandboxConfig().to_limits()` converts, and tests/sandbox pin that the two agree on names and defaults.
"""
from __future__ import annotations

from pydantic import Field

from rstar_hpc.config.base import Section


class SandboxConfig(Section):
    num_workers: int = Field(0, ge=0)
    """Sandboxes per service; 0 means one per core."""
    timeout_s: float = Field(4.0, gt=0, le=600)
    """Wall-time limit of one call (the paper's service used 4 s)."""
    max_timeout_s: float = Field(60.0, gt=0, le=3600)
    """Largest wall time a single request may ask for."""
    cpu_time_s: float = Field(4.0, gt=0, le=600)
    """CPU-time limit of one call (RLIMIT_CPU, hard)."""
    memory_mb: int = Field(1024, ge=64)
    """Address space a call may add to the warm interpreter (RLIMIT_AS, hard)."""
    max_processes: int = Field(32, ge=1)
    """Processes/threads a call may hold (RLIMIT_NPROC, counted per sandbox)."""
    open_files: int = Field(64, ge=16)
    """Open file descriptors of a call (RLIMIT_NOFILE)."""
    file_size_mb: int = Field(16, ge=1)
    """Largest file a call may write (RLIMIT_FSIZE)."""
    scratch_mb: int = Field(256, ge=1)
    """Size of each sandbox's private tmpfs /tmp (and /dev/shm)."""
    max_output_bytes: int = Field(8192, ge=256)
    """stdout/stderr kept per call (head and tail beyond this)."""
    output_kill_bytes: int = Field(4 << 20, ge=256)
    """A call printing more than this (both streams together) is killed."""
    max_code_bytes: int = Field(1 << 20, ge=1024)
    """Largest code of one call."""
    max_stdin_bytes: int = Field(1 << 20, ge=0)
    """Largest stdin of one call."""
    max_request_bytes: int = Field(16 << 20, ge=1 << 16)
    """Largest network frame (one batch of up to 64 calls)."""
    display_last_expression: bool = True
    """Print a cell's bare last expression as repr(), as rStar2's tool (and IPython) do; false: exactly what
    `python3 main.py` prints."""
    recycle_after: int = Field(10000, ge=1)
    """Calls before a sandbox is replaced by a fresh one. A guard against slow drift of the long-lived pid 1 and
    fork server (neither runs user code; each call's processes and files are swept): a replacement costs ~0.15 s
    of CPU for a light sandbox (namespaces, interpreter, warm-up) and seconds for a math one, so at 1000 it was
    ~4% of a pool's CPU on trivial calls."""
    pin_cpus: bool = True
    """Pin each sandbox (its pid 1, fork server and cells) to one CPU of the service's allowed set, round-robin
    within each kind (math, light). A call's processes then hand off on one core instead of waking each other
    across cores: 9-12% more trivial calls per second on the 2-core bench machine (12 interleaved pairs, 10 won).
    Turn it off on a node the service shares with other busy jobs."""
    preload: list[str] = ["numpy", "sympy"]
    """Modules imported once in every math sandbox (calls fork from the warm interpreter)."""
    light_workers: int = Field(-1, ge=-1)
    """Light sandboxes (stdlib-only, cheap to fork) for stateless calls importing nothing heavy; -1 = as many as num_workers, 0 = none."""
    light_preload: list[str] = ["math", "cmath", "fractions", "decimal", "itertools", "functools", "collections",
                                "re", "heapq", "bisect", "string", "errno"]
    """Standard-library modules imported once in every light sandbox."""
    max_sessions_per_worker: int = Field(32, ge=1)
    """Live sessions one sandbox holds; the least recently used goes beyond it."""
    session_idle_s: float = Field(600.0, gt=0)
    """A session unused this long is evicted (replayed if used again)."""
    session_memory_mb: int = Field(4096, ge=64)
    """Memory of all live sessions of a service (anonymous memory beyond the warm interpreter); the least recently used are evicted beyond it."""
    max_history_bytes: int = Field(1 << 20, ge=0)
    """Code kept per session to replay it after eviction; beyond it an evicted session is reported lost."""
    stats_interval_s: float = Field(30.0, gt=0)
    """Seconds between the service's summary log lines / stats file updates."""

    def to_limits(self):
        from sandbox.limits import Limits

        fields = self.model_dump(exclude={"stats_interval_s"})
        fields["preload"] = tuple(fields["preload"])
        fields["light_preload"] = tuple(fields["light_preload"])
        return Limits(**fields)
