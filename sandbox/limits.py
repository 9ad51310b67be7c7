"""The service's knobs as a plain dataclass (rstar_hpc.config.sandbox mirrors it for YAML runs)."""
from __future__ import annotations

import dataclasses
import os

# exercises the code paths model-written math cells hit first (sympy's parser, cache and polys; numpy's linalg)
WARMUP = """
import numpy, sympy
x = sympy.Symbol("x")
sympy.factor(x**2 - 1); sympy.simplify(sympy.sin(x)**2 + sympy.cos(x)**2); sympy.sympify("x + 1")
sympy.solve(x**2 - 4, x); sympy.Rational(1, 3) + 1; sympy.isprime(97)
numpy.linalg.det(numpy.eye(3)); numpy.arange(10).sum()
"""


@dataclasses.dataclass
class Limits:
    # per call
    timeout_s: float = 4.0            # default wall time of a call (the paper's service used 4 s)
    max_timeout_s: float = 60.0       # a request may ask for up to this much wall time
    cpu_time_s: float = 4.0           # RLIMIT_CPU of a cell (SIGXCPU, then SIGKILL one second later)
    memory_mb: int = 1024             # address space a cell may add to the warm interpreter (RLIMIT_AS)
    max_processes: int = 32           # processes + threads a cell may add (RLIMIT_NPROC, see nproc())
    open_files: int = 64              # RLIMIT_NOFILE
    file_size_mb: int = 16            # RLIMIT_FSIZE: largest file a cell may write
    scratch_mb: int = 256             # size of the sandbox's private tmpfs (/tmp; /dev/shm gets the same)
    max_output_bytes: int = 8192      # stdout and stderr each keep head + tail of this many bytes
    output_kill_bytes: int = 4 << 20  # a cell printing more than this (both streams) is killed
    max_code_bytes: int = 1 << 20     # code of one call
    max_stdin_bytes: int = 1 << 20    # stdin of one call
    max_request_bytes: int = 16 << 20  # one network frame (a batch of calls)
    # print a cell's bare last expression as repr(), as rStar2's tool (and IPython) do; off: exactly what
    # `python3 main.py` prints
    display_last_expression: bool = True
    # pool
    num_workers: int = 0              # sandboxes; 0 = one per core this process may use
    recycle_after: int = 10000        # calls before a sandbox is replaced (a start costs ~0.15 s CPU)
    start_timeout_s: float = 60.0     # a sandbox that is not ready by then is an error
    hang_grace_s: float = 5.0         # a sandbox silent this long past a call's deadline is replaced
    # each sandbox (pid 1, fork server, cells) on one CPU of this process's set, round-robin within each kind:
    # a call's processes hand off on one core instead of waking each other across cores (bench/sandbox.py)
    pin_cpus: bool = True
    preload: tuple[str, ...] = ("numpy", "sympy")
    # light sandboxes: stdlib-only interpreters (cheap to fork) for stateless calls that import nothing
    # heavy (sandbox.route); -1 = as many as the math sandboxes, 0 = none (every call runs in a math one)
    light_workers: int = -1
    # (not random: its at-fork reseed alone costs each forked cell ~40 page faults; cells importing a module
    # the light interpreter lacks go to math sandboxes, see sandbox.route)
    light_preload: tuple[str, ...] = ("math", "cmath", "fractions", "decimal", "itertools", "functools",
                                      "collections", "re", "heapq", "bisect", "string", "errno")
    warmup: str = WARMUP             # run once in each sandbox's interpreter before it forks any cell
    # sessions
    max_sessions_per_worker: int = 32
    session_idle_s: float = 600.0
    session_memory_mb: int = 4096     # memory (anon growth over the warm interpreter) of all live sessions; LRU ones go beyond it
    max_history_bytes: int = 1 << 20  # code kept per session for replay after eviction
    # uid the sandboxes run as when the service runs as root (a free uid range; see pool.sandbox_uid)
    root_uid_base: int = 1_000_000

    def __post_init__(self) -> None:
        if isinstance(self.preload, list):
            self.preload = tuple(self.preload)
        if isinstance(self.light_preload, list):
            self.light_preload = tuple(self.light_preload)
        for name in ("timeout_s", "max_timeout_s", "cpu_time_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name} must be > 0, got {getattr(self, name)!r}")
        if self.timeout_s > self.max_timeout_s:
            raise ValueError(f"Limits.timeout_s ({self.timeout_s}) exceeds max_timeout_s ({self.max_timeout_s})")
        if self.max_output_bytes < 64 or self.output_kill_bytes < self.max_output_bytes:
            raise ValueError("Limits.max_output_bytes must be >= 64 and <= output_kill_bytes")

    def workers(self) -> int:
        if self.num_workers > 0:
            return self.num_workers
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:
            return max(1, os.cpu_count() or 1)

    def light(self) -> int:
        return self.workers() if self.light_workers < 0 else self.light_workers

    def nproc(self) -> int:
        # RLIMIT_NPROC counts every process of the sandbox's uid in its namespace, including pid 1 and the
        # session holders, so the cap a cell sees is its own budget plus those
        return self.max_processes + self.max_sessions_per_worker + 4

    def for_worker(self) -> dict:
        """The subset pid 1 inside the sandbox needs, as plain JSON."""
        return {"cpu_time_s": self.cpu_time_s, "memory_mb": self.memory_mb, "nproc": self.nproc(),
                "open_files": self.open_files, "file_size_mb": self.file_size_mb,
                "max_output_bytes": self.max_output_bytes, "output_kill_bytes": self.output_kill_bytes,
                "scratch_mb": self.scratch_mb, "display": self.display_last_expression}
