"""Which committed trainer checkpoint an export reads: RUN or CKPT_DIR, narrowed by --stage and --step.

    RUN                    a run directory (or a run name under $RSTAR_HPC_RUN_ROOT): its newest checkpoint
    RUN/ckpt/<stage>       that stage's newest checkpoint
    RUN/ckpt/<stage>/step-N  that checkpoint

"Newest" is the most recently committed (COMMITTED.json's `committed_at`): the last trainer stage's latest
checkpoint. Any committed checkpoint works, not only those whose policy retention kept under policy/.
Stdlib and the exchange only: `rstar-hpc eval --policy` resolves checkpoints with it before anything heavy loads.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from rstar_hpc.config import ConfigError
from rstar_hpc.exchange.rundir import RunPaths

_STEP_DIR = re.compile(r"step-(\d+)")
_STAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


class ExportError(ConfigError):
    """A user error (exit 3): no such checkpoint, conflicting options, OUT in the way."""


class RunNotFound(ExportError):
    """RUN names no directory (exit 4, as for every verb)."""


@dataclass(frozen=True)
class Checkpoint:
    paths: RunPaths
    stage: str
    step: int

    @property
    def dir(self) -> Path:
        return self.paths.checkpoints(self.stage).path(self.step)

    def __str__(self) -> str:
        return f"checkpoint {self.stage}/step-{self.step} of run {self.paths.dir}"


def find_checkpoint(spec: str | os.PathLike, stage: str | None = None, step: int | None = None) -> Checkpoint:
    """The committed checkpoint SPEC (RUN or CKPT_DIR) and the options name; ExportError naming what there is."""
    path = Path(spec).expanduser().absolute()
    m = _STEP_DIR.fullmatch(path.name)
    if m and path.parent.parent.name == "ckpt":
        run, stage = path.parents[2], _agree("--stage", stage, path.parent.name, spec)
        step = _agree("--step", step, int(m.group(1)), spec)
    elif path.parent.name == "ckpt" and path.is_dir():
        run, stage = path.parents[1], _agree("--stage", stage, path.name, spec)
    else:
        try:
            run = RunPaths.resolve(spec).dir
        except FileNotFoundError as e:
            raise RunNotFound(f"{e} Or pass a checkpoint directory, RUN/ckpt/<stage>/step-N.") from None
    paths = RunPaths(run)
    found = committed(paths)
    if not found:
        raise ExportError(f"{paths.dir} holds no committed trainer checkpoint (ckpt/<stage>/step-N with "
                          f"COMMITTED.json); train a stage first, or point at the run that did")
    return Checkpoint(paths, *_pick(found, stage, step, paths))


def committed(paths: RunPaths) -> dict[str, list[int]]:
    """Stage -> its committed checkpoint steps (ascending), stages ordered oldest to newest commit."""
    root = paths.dir / "ckpt"
    stages = sorted(n for n in os.listdir(root) if _STAGE.fullmatch(n)) if root.is_dir() else []
    steps = {s: paths.checkpoints(s).complete_steps() for s in stages}
    steps = {s: v for s, v in steps.items() if v}
    return dict(sorted(steps.items(), key=lambda kv: paths.checkpoints(kv[0]).marker(kv[1][-1]).get("committed_at", 0)))


def _pick(found: dict[str, list[int]], stage: str | None, step: int | None, paths: RunPaths) -> tuple[str, int]:
    listing = "; ".join(f"{s}: steps {', '.join(map(str, v))}" for s, v in found.items())
    if stage is None and step is not None:
        holding = [s for s, v in found.items() if step in v]
        if len(holding) > 1:
            raise ExportError(f"step {step} has a checkpoint in stages {', '.join(holding)} of {paths.dir}; pick one "
                              f"with --stage")
        stage = holding[0] if holding else None
        if stage is None:
            raise ExportError(f"no committed checkpoint at step {step} in {paths.dir} (committed: {listing}); pass one "
                              f"of those steps, with --stage when it is not the newest stage's")
    stage = stage if stage is not None else list(found)[-1]
    if stage not in found:
        raise ExportError(f"no committed checkpoint of stage {stage!r} in {paths.dir} (committed: {listing}); pass "
                          f"--stage with one of {', '.join(found)}")
    if step is None:
        return stage, found[stage][-1]
    if step not in found[stage]:
        raise ExportError(f"no committed checkpoint at step {step} of stage {stage!r} in {paths.dir}: its steps are "
                          f"{', '.join(map(str, found[stage]))} (older ones were pruned by "
                          f"trainer.checkpoint.keep_last); pass one of them")
    return stage, step


def _agree(option: str, given, implied, spec):
    if given is not None and given != implied:
        raise ExportError(f"{option} {given} contradicts {spec}, which names {implied}; drop {option} or point at "
                          f"the run directory")
    return implied
