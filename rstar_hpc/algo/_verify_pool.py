"""Run math-verify in worker processes with a hard wall-clock limit per answer.

math-verify's own timeouts use SIGALRM, which only interrupts Python bytecode: `9^{9^{9^{9}}}` hangs inside
a big-integer power and a 5000-deep `\\frac` hangs the LaTeX parser, and either can also exhaust memory or
the C stack. So each answer runs in a child process that the parent SIGKILLs at its deadline (or finds
dead) and replaces; the answer scores 0 with the reason, and the pool keeps serving.

The limit is CPU time, so that a verification starved by a busy node (other jobs, the trainer) is not
scored 0 for being slow to get a core; wall-clock time is capped at WALL_FACTOR x the limit regardless.
Where /proc is missing the limit is wall-clock time.

Workers are plain subprocesses (`python -m rstar_hpc.algo._verify_pool`) speaking JSON lines on stdin/stdout:
unlike multiprocessing's fork they never copy the caller's threads (torch, NCCL), and unlike spawn/forkserver
they never re-import the caller's `__main__`. A worker says `ready` once math-verify is imported, so its
start-up never eats into an answer's time limit. Not thread-safe across batches; one batch at a time.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import wait
from pathlib import Path
from typing import Sequence

_PKG_ROOT = str(Path(__file__).resolve().parents[2])
WALL_FACTOR = 4.0
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, or inf where it cannot be read (the limit becomes wall time)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return float("inf")


def _serve() -> None:
    import logging

    # math-verify logs a warning on every call when its own (SIGALRM) timeouts are off; the parent enforces time
    logging.disable(logging.WARNING)
    from math_verify import parse, verify

    print("ready", flush=True)
    for line in sys.stdin:
        pred, gold = json.loads(line)
        try:
            ok = verify(parse(f"\\boxed{{{gold}}}", parsing_timeout=None),
                        parse(f"\\boxed{{{pred}}}", parsing_timeout=None), timeout_seconds=None, raise_on_error=True)
            out = ["correct" if ok else "wrong", ""]
        except Exception as e:  # RecursionError on deep nesting, sympy errors: a wrong answer, not a crash
            out = ["verifier_error", f"{type(e).__name__}: {e}"[:200]]
        print(json.dumps(out), flush=True)


class _Worker:
    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_PKG_ROOT, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, "-m", "rstar_hpc.algo._verify_pool"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self.out = self.proc.stdout

    def send(self, pair: tuple[str, str]) -> None:
        self.proc.stdin.write(json.dumps(pair) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


class VerifierPool:
    """Up to `num_workers` math-verify processes, started as a batch needs them; `verify_many` returns one
    `(reason, detail)` per pair, reason being `correct`, `wrong`, `verifier_error`, `timeout` or
    `verifier_crashed`."""

    def __init__(self, num_workers: int, timeout_s: float):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers, self.timeout_s = num_workers, timeout_s
        self._ready: list[_Worker] = []
        self._starting: list[_Worker] = []
        self._lock = threading.Lock()
        self.num_replaced = 0

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self.num_replaced += 1
        self._starting.append(_Worker())

    def verify_many(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
        """Verify `(prediction, ground_truth)` pairs, each within `timeout_s` of being handed to a worker."""
        with self._lock:
            while len(self._ready) + len(self._starting) < min(self.num_workers, len(pairs)):
                self._starting.append(_Worker())
            results: list[tuple[str, str] | None] = [None] * len(pairs)
            todo, busy = deque(enumerate(pairs)), {}  # stdout -> (worker, index, deadline, start, start cpu)
            try:
                while todo or busy:
                    while todo and self._ready:
                        w, (i, pair) = self._ready.pop(), todo.popleft()
                        w.send(pair)
                        now = time.monotonic()
                        busy[w.out] = (w, i, now + self.timeout_s, now, _cpu_seconds(w.proc.pid))
                    starting = {w.out: w for w in self._starting}
                    deadline = min((b[2] for b in busy.values()), default=time.monotonic() + 60.0)
                    for out in wait([*busy, *starting], timeout=max(0.0, deadline - time.monotonic())):
                        line = out.readline()
                        if out in starting:
                            w = starting[out]
                            self._starting.remove(w)
                            if line.strip() == "ready":
                                self._ready.append(w)
                            else:  # cannot even import math-verify: fail loudly, not one answer at a time
                                w.kill()
                                raise RuntimeError("a verifier worker failed to start; run "
                                                   f"`{sys.executable} -m rstar_hpc.algo._verify_pool` to see why")
                            continue
                        w, i = busy.pop(out)[:2]
                        if line:
                            results[i] = tuple(json.loads(line))  # type: ignore[assignment]
                            self._ready.append(w)
                        else:  # EOF: segfault, OOM kill, C stack overflow
                            try:
                                code = w.proc.wait(timeout=1.0)  # EOF can come before the exit is reaped
                            except subprocess.TimeoutExpired:
                                code = None
                            results[i] = ("verifier_crashed", f"worker exited with code {code}")
                            self._replace(w)
                    now = time.monotonic()
                    for out, (w, i, d, start, cpu0) in list(busy.items()):
                        if d > now:
                            continue
                        cpu = _cpu_seconds(w.proc.pid) - cpu0
                        wall_cap = start + WALL_FACTOR * self.timeout_s
                        if cpu < 0.95 * self.timeout_s and now < wall_cap:  # starved of CPU, not slow: wait on
                            busy[out] = (w, i, min(wall_cap, now + self.timeout_s - cpu), start, cpu0)
                            continue
                        del busy[out]
                        results[i] = ("timeout", f"verification exceeded {self.timeout_s:g} s "
                                                 f"({cpu:.2f} s CPU, {now - start:.2f} s wall)")
                        self._replace(w)
            finally:
                # interrupted mid-batch: the workers still busy hold stale tasks
                for b in busy.values():
                    self._replace(b[0])
            return results  # type: ignore[return-value]

    def close(self) -> None:
        for w in self._ready + self._starting:
            w.kill()
        self._ready, self._starting = [], []

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    _serve()
