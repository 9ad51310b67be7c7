"""Rank 0's progress over a rollout stage: problems done / total, generated tokens per second, ETA.

A problem is done once all its samples are (k at eval). On a terminal it is a tqdm bar on stderr; otherwise (a
Slurm log, a pipe) one log line every `every_s` seconds, since a bar's carriage returns make a log unreadable.
The scheduler calls it with each finished trajectory's key and model tokens (rollout/scheduler.py).
"""
from __future__ import annotations

import collections
import logging
import sys
import time
from collections.abc import Iterable

from rstar_hpc import pipeline
from rstar_hpc.exchange.writer import ShardWriter

log = logging.getLogger("rstar_hpc.rollout")
TTY_ENV = "RSTAR_HPC_PROGRESS_TTY"   # set by a local launcher whose stderr is a terminal (mpirun pipes the ranks')


def stage_problem_counts(cfg, paths, stage_name: str) -> tuple[int, int]:
    """(problems in the stage, problems in its steps committed already)."""
    stage = cfg.stage(stage_name)
    rows = None if stage.kind == "rl" else len(pipeline.stage_prompts(cfg, stage))
    total = done = 0
    for step in range(pipeline.rollout_steps(stage, rows)):
        n = stage.prompts_per_step if rows is None else \
            max(0, min(stage.prompts_per_step, rows - step * stage.prompts_per_step))
        total += n
        if ShardWriter.is_committed(paths, stage_name, step, pipeline.PRODUCER):
            done += n
    return total, done


class StageProgress:
    def __init__(self, stage: str, total: int, done: int = 0, *, every_s: float = 30.0, tty: bool | None = None):
        self.stage, self.total, self.done, self.initial, self.every_s = stage, total, done, done, every_s
        self.tokens = 0
        self.t0 = self.last_log = time.monotonic()
        self.samples: dict[str, int] = {}                       # this step's samples per problem
        self.finished: collections.Counter = collections.Counter()
        self.bar = None
        if sys.stderr.isatty() if tty is None else tty:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=done, desc=f"rollout {stage}", unit="problem", file=sys.stderr,
                            dynamic_ncols=True)

    def start_step(self, items: Iterable) -> None:
        self.samples = dict(collections.Counter(item.prompt_uid for item in items))
        self.finished.clear()

    def __call__(self, keys: list[tuple[str, int]], tokens: int = 0) -> None:
        """Trajectories `keys` ((prompt uid, sample index)) finished with `tokens` model tokens in all."""
        self.tokens += tokens
        newly = 0
        for uid, _ in keys:
            self.finished[uid] += 1
            if self.finished[uid] == self.samples.get(uid, 0):
                newly += 1
        self.done += newly
        rate = self.tokens / max(time.monotonic() - self.t0, 1e-6)
        if self.bar is not None:
            self.bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)
            self.bar.update(newly)
        elif time.monotonic() - self.last_log >= self.every_s or self.done == self.total and newly:
            self.last_log = time.monotonic()
            log.info("%s", self.line(rate))

    def line(self, rate: float) -> str:
        elapsed = time.monotonic() - self.t0
        fresh = self.done - self.initial
        eta = (self.total - self.done) * elapsed / fresh if fresh > 0 else None
        return (f"rollout {self.stage}: {self.done}/{self.total} problems, {rate:,.0f} tok/s, ETA "
                f"{'?' if eta is None else _duration(eta)}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
