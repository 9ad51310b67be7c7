"""The metrics sink: every role's per-step record goes to `metrics/<role>.jsonl` and to TensorBoard.

    sink = metrics_sink(paths, "trainer")
    sink.write({"stage": "rl", "step": 3, "loss": 0.1, ...})                 # tag trainer/loss, step 3
    sink.write({"stage": "eval", "benchmark": "aime24", "pass1": 0.4}, step=0, group="aime24")  # eval/aime24/pass1

The JSONL line is exactly `json.dumps(record)`: other code reads these files (the report, `train --follow`'s
progress bar, tests), so the sink adds nothing to it. TensorBoard gets the record's numbers (nested dicts
flattened, None/NaN, strings, lists and bools left out) under `RUN/tb/<stage>/` (one TensorBoard run per stage, so
steps that restart at each stage do not share a curve), tag `<role>[/<group>]/<key>` with `(unit)` suffixes
turned into `_unit` (TensorBoard's tag alphabet). Each record is flushed as it is written, so a preempted job
loses nothing; each process writes its own event file (host and pid in the name), so a requeued job appends
beside the old one. TensorBoard is a view: if it is missing or fails, the role logs one warning and goes on with
the JSONL alone. RSTAR_HPC_TENSORBOARD=0 turns it off.

The trackers the run's config.yaml enables (`tracking:`: W&B, MLflow; rstar_hpc/tracking/) get the same numbers
under the same tags, prefixed with the stage (`rl-8k/trainer/loss` at the stage's step). Where NVML finds a GPU,
each step record (one without a group) also brings `<role>/gpu<i>/util_pct`, `mem_used_GiB` and `mem_pct` to every view.
A tracker that fails is dropped with one warning, like TensorBoard.
"""
from __future__ import annotations

import atexit
import json
import logging
import math
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rstar_hpc.exchange.rundir import RunPaths

log = logging.getLogger("rstar_hpc.metrics")
TB_ENV = "RSTAR_HPC_TENSORBOARD"
INDEX_KEYS = ("stage", "step", "time")   # what places a record; not a scalar of its own
_SINKS: dict[tuple[Path, str], MetricsSink] = {}


def tb_tag(key: str) -> str:
    """A JSONL key as a TensorBoard tag: `time/step(s)` -> `time/step_s`; other characters outside TensorBoard's
    tag alphabet become `_` (TensorBoard would rename them itself, with a log line per tag)."""
    key = re.sub(r"\(([^)]*)\)", r"_\1", key)
    return re.sub(r"[^-/\w.]", "_", key).strip("_") or "_"


def scalars(record: dict, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(key, value) of every finite number in `record`, nested dicts flattened with `/`."""
    for key, value in record.items():
        if not prefix and key in INDEX_KEYS:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from scalars(value, f"{name}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            yield name, float(value)


class MetricsSink:
    """One role's metrics in one run directory (use `metrics_sink`: one per process and role)."""

    def __init__(self, paths: RunPaths, role: str, *, tensorboard: bool | None = None):
        self.paths, self.role = paths, role
        self.path = paths.metrics(role)
        self.tensorboard = os.environ.get(TB_ENV, "1") != "0" if tensorboard is None else tensorboard
        self._writers: dict[str, Any] = {}
        self._trackers: list | None = None   # opened at the first record they get
        self._gpu: bool | None = None        # tracking.gpu, read at the first record

    def write(self, record: dict, *, step: int | None = None, group: str | None = None) -> None:
        """Append `record` as one JSON line; mirror its numbers to TensorBoard and the trackers at `step` (default:
        the record's own `step`; records without one, or without a `stage`, are not mirrored)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        step = record.get("step") if step is None else step
        if not (isinstance(record.get("stage"), str) and isinstance(step, int)):
            return
        values = self._tagged(record, group)
        if self.tensorboard:
            self._to_tensorboard(record, values, step)
        self._to_trackers(record["stage"], values, step)

    def _tagged(self, record: dict, group: str | None) -> dict[str, float]:
        """The record's numbers by view tag, `<role>[/<group>]/<key>`; a step record brings this node's GPUs."""
        from rstar_hpc.tracking import gpu_enabled
        from rstar_hpc.tracking.gpu import gpu_figures

        prefix = "/".join([self.role] + ([tb_tag(group)] if group else []))
        values = {f"{prefix}/{tb_tag(key)}": value for key, value in scalars(record)}
        if self._gpu is None:
            self._gpu = gpu_enabled(self.paths)
        if group is None and self._gpu:
            values.update({f"{prefix}/{tb_tag(key)}": value for key, value in gpu_figures().items()})
        return values

    def _to_trackers(self, stage: str, values: dict[str, float], step: int) -> None:
        if self._trackers is None:
            from rstar_hpc.tracking import open_trackers
            self._trackers = open_trackers(self.paths, self.role)
        for tracker in list(self._trackers):
            try:
                tracker.log(stage, step, values)
            except Exception as e:   # noqa: BLE001  (a view must never stop a role's step)
                log.warning("%s off for %s: %s: %s (metrics/%s.jsonl is unaffected)", type(tracker).__name__,
                            self.role, type(e).__name__, e, self.role)
                self._trackers.remove(tracker)

    def _to_tensorboard(self, record: dict, values: dict[str, float], step: int) -> None:
        try:
            writer = self._writer(record["stage"])
            wall = record.get("time") if isinstance(record.get("time"), (int, float)) else time.time()
            for tag, value in values.items():
                writer.add_scalar(tag, value, step, walltime=wall)
            writer.flush()   # a preempted job keeps every record it wrote
        except Exception as e:   # noqa: BLE001  (a view must never stop a role's step)
            log.warning("TensorBoard output off for %s: %s: %s (metrics/%s.jsonl is unaffected)", self.role,
                        type(e).__name__, e, self.role)
            self.tensorboard = False

    def _writer(self, stage: str):
        if stage not in self._writers:
            from torch.utils.tensorboard import SummaryWriter  # lazy: torch and tensorboard are heavy imports

            folder = self.paths.tb_dir(stage)
            folder.mkdir(parents=True, exist_ok=True)
            # the event file name carries time, host and pid; the suffix says which role wrote it
            self._writers[stage] = SummaryWriter(str(folder), filename_suffix=f".{self.role}")
        return self._writers[stage]

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
        for tracker in self._trackers or ():
            try:
                tracker.close()
            except Exception as e:   # noqa: BLE001  (at exit: the records are written already)
                log.warning("closing %s for %s: %s", type(tracker).__name__, self.role, e)
        self._trackers = None


def read_records(path: str | os.PathLike) -> list[dict]:
    """The records of a `metrics/<role>.jsonl` in order ([] when it does not exist yet); a line cut by a kill is
    skipped (the record after it is whole)."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return out


def metrics_sink(paths: RunPaths, role: str) -> MetricsSink:
    """This process's sink for `role` in the run `paths`: one event file per process, however many times a
    role's step objects ask for it."""
    key = (paths.dir, role)
    if key not in _SINKS:
        _SINKS[key] = MetricsSink(paths, role)
    return _SINKS[key]


@atexit.register
def close_all() -> None:
    """Close every sink of this process (at exit; before an os._exit, which skips atexit: a W&B run not finished
    may lose its last records)."""
    for sink in _SINKS.values():
        sink.close()
    _SINKS.clear()
