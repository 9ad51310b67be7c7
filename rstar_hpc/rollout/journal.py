"""A rollout step's journal: the trajectories it has finished so far, committed in parts while it runs.

Each part is an ordinary committed shard set of producer `rollout-part-<n>` in the step's directory (the exchange's
own atomic protocol: a part is whole or absent). A restarted step loads every part, keeps those trajectories and
runs only the rest; its final commit (producer `rollout`, what the trainer reads) holds the step's trajectories in
item order, as an uninterrupted step's would, and the parts are removed after it. Readers of the step never look
at parts.
"""
from __future__ import annotations

import logging
import os
import re
import time

from rstar_hpc.exchange.reader import StepReader
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.writer import ShardWriter

log = logging.getLogger("rstar_hpc.rollout")
PART = "rollout-part-"
_PART = re.compile(rf"^{PART}(\d+)$")


class Journal:
    def __init__(self, paths: RunPaths, stage: str, step: int, every_s: float):
        self.paths, self.stage, self.step, self.every_s = paths, stage, step, every_s
        self.written: set[tuple] = set()   # keys already in a part
        self.next_part = 0
        self.loaded = 0
        self.last = time.monotonic()

    def parts(self) -> dict[str, dict]:
        commits = StepReader(self.paths, self.stage).commits(self.step)
        return {p: r for p, r in commits.items() if _PART.match(p)}

    def load(self) -> dict[tuple, object]:
        """The trajectories of every committed part, by (prompt_uid, sample_index)."""
        from rstar_hpc.exchange.columns import from_table

        parts = self.parts()
        if not parts:
            return {}
        self.next_part = 1 + max(int(_PART.match(p).group(1)) for p in parts)
        table = StepReader(self.paths, self.stage).read(self.step, producers=sorted(parts), records=parts)
        out = {t.key: t for t in from_table(table)}
        self.written.update(out)
        self.loaded = len(out)
        return out

    def maybe_write(self, results: dict[tuple, object], force: bool = False) -> None:
        """Commit the results not in a part yet, every `every_s` seconds (0: never; only the final commit)."""
        if self.every_s <= 0 or (not force and time.monotonic() - self.last < self.every_s):
            return
        self.last = time.monotonic()
        new = [t for k, t in results.items() if k not in self.written]
        if not new:
            return
        with ShardWriter(self.paths, self.stage, self.step, f"{PART}{self.next_part:04d}") as w:
            w.write(new)
        self.next_part += 1
        self.written.update(t.key for t in new)

    def clear(self) -> None:
        """After the step's final commit: the parts are redundant (nothing reads them)."""
        folder = self.paths.traj_step_dir(self.stage, self.step)
        for name in os.listdir(folder) if folder.is_dir() else ():
            if name.startswith(PART):
                try:
                    os.unlink(folder / name)
                except FileNotFoundError:
                    pass
