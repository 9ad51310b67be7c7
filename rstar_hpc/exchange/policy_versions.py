"""Policy versions: how they are numbered, recorded and looked up (the one place; stdlib only).

Numbering: run-global and monotonic, across stages and restarts. Version 0 is the base model (never published);
each new version is the newest one published as files (RUN/policy/v-*, complete with COMMITTED.json) or ever
offered in memory (RUN/policy/memory.json), + 1 (`next_version`). A version offered in memory and also published
as files has the same number in both places; steps offered in memory only leave gaps among the files. A restarted
trainer retrains from its checkpoint and takes the next number, never one that engines may run already.

What a version is made of: the weights after trainer step `trainer_step` of stage `stage`, as a published
directory's COMMITTED.json says (trainer/publish.py), and so do the in-memory offer (exchange/weight_protocol.py)
and its record here. A policy need (pipeline.PolicyNeed: `stage`, `trainer_step`) is satisfied by a version of
that stage at that trainer step or later (`satisfies`; what a rollout step may run), and made of exactly it
(`made_of`; what the trainer holds).

Who calls: the trainer numbers (trainer/weight_sender.py `publish_step`, trainer/publish.py `publish_policy`), its
server records each in-memory offer (`record_offered`); the trainer looks up the version it holds
(`version_made_of`), the rollout's rank 0 the newest one a step may run (`newest_published_for`, `offered_for`).
"""
from __future__ import annotations

import json
import os
import time

from rstar_hpc.exchange.atomic import atomic_write_text
from rstar_hpc.exchange.rundir import RunPaths

BASE = 0
"""The base model's version: what a need with no stage runs, and what a run with nothing published holds."""
OFFERED = "memory.json"
"""Under RUN/policy/: the newest version offered in memory {version, stage, trainer_step, time}."""


# ------------------------------------------------------------------------------------------------ numbering
def newest_published(paths: RunPaths) -> int:
    """The newest version published as files (BASE if none)."""
    latest = paths.policies().latest()
    return latest[0] if latest else BASE


def next_version(paths: RunPaths) -> int:
    """The number of the next version: the newest published as files or ever offered in memory, + 1."""
    return max(newest_published(paths), newest_offered_version(paths.dir)) + 1


# ------------------------------------------------------------------------------------------------ the memory record
def _offered_path(run_dir: str | os.PathLike):
    return RunPaths(run_dir).policy_root / OFFERED


def read_offered(run_dir: str | os.PathLike) -> dict | None:
    """The record of the newest version offered in memory, or None (none ever was)."""
    try:
        return json.loads(_offered_path(run_dir).read_text())
    except (FileNotFoundError, ValueError):
        return None


def newest_offered_version(run_dir: str | os.PathLike) -> int:
    """The newest version ever offered in memory (BASE if none): kept after the trainer exits and withdraws its
    offer, so a restarted trainer numbers on from it."""
    offer = read_offered(run_dir)
    return int(offer.get("version", BASE)) if offer else BASE


def record_offered(run_dir: str | os.PathLike, version: int, stage: str, trainer_step: int) -> None:
    """Trainer rank 0: remember the newest version offered in memory (RUN/policy/memory.json), so the numbering
    stays monotonic across restarts even when no file publish followed."""
    path = _offered_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"version": int(version), "stage": stage, "trainer_step": int(trainer_step),
                                        "time": time.time()}) + "\n")


# ------------------------------------------------------------------------------------------------ look-ups
def satisfies(record: dict, need) -> bool:
    """A version's record (COMMITTED.json, the offer, memory.json) is one `need` may run: its stage, at its
    trainer step or later."""
    return record.get("stage") == need.stage and int(record.get("trainer_step", -1)) >= need.trainer_step


def made_of(record: dict, need) -> bool:
    """A version's record is made of exactly the weights `need` names."""
    return record.get("stage") == need.stage and int(record.get("trainer_step", -1)) == need.trainer_step


def newest_published_for(paths: RunPaths, need, marker=None) -> int | None:
    """The newest version published as files that satisfies `need`, or None. `marker(v)`: reads version v's
    COMMITTED.json (default: from disk; a caller that looks often passes a cache, markers never change)."""
    dirs = paths.policies()
    marker = marker or dirs.marker
    return next((v for v in sorted(dirs.complete_steps(), reverse=True) if satisfies(marker(v), need)), None)


def offered_for(offer: dict | None, need) -> int | None:
    """The version of the trainer's in-memory offer (weight_protocol.read_offer) if it satisfies `need`."""
    return int(offer["version"]) if offer is not None and satisfies(offer, need) else None


def version_made_of(paths: RunPaths, need) -> int | None:
    """The version made of exactly the weights `need` (pipeline.PolicyNeed) names: BASE for the base model, else
    the newest published as files or recorded as offered in memory (a retrained step may have made two); None if
    neither knows one (the trainer then treats every token as another policy's)."""
    if need.stage is None:
        return BASE
    dirs = paths.policies()
    found = [next((v for v in sorted(dirs.complete_steps(), reverse=True) if made_of(dirs.marker(v), need)), None)]
    offered = read_offered(paths.dir)
    if offered is not None and made_of(offered, need):
        found.append(int(offered["version"]))
    return max((v for v in found if v is not None), default=None)
