"""Partial rollouts' carry: what a closed step hands to the next step of its stage.

A step with rollout.scheduler.partial_rollouts closes once `close_threshold` of its groups are complete and trains
those groups. Every other item of the step is carried: paused mid-trajectory (its work item holds the agent loop's
state to resume), never started, or finished but waiting for its siblings (its scored row). The carry is written
to RunPaths.rollout_carry(stage, step) BEFORE the step's trajectories are committed, and the next step reads it only
once that commit exists. A kill before the commit re-runs the step (its journal keeps what it finished; the carry
it started from is still there); a kill after it resumes from this carry. So nothing is lost, and each trajectory is
in exactly one committed step: the one that completes its group.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from rstar_hpc.exchange.atomic import atomic_write_json
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.schema import Trajectory
from rstar_hpc.rollout.agent import AgentResult
from rstar_hpc.rollout.step import WorkItem


@dataclass
class Carry:
    items: list[WorkItem] = field(default_factory=list)
    """To run in the next step, first: paused (item.resume holds the agent loop's state) or never started. On disk an
    item is its fields, `resume` as AgentResult.to_dict (a file of an earlier version loads too: from_dict)."""
    finished: list[Trajectory] = field(default_factory=list)
    """Done, waiting for their group to complete."""

    def __len__(self) -> int:
        return len(self.items) + len(self.finished)


def close_threshold(groups: int, fraction: float) -> int:
    """Complete groups a step of `groups` groups needs before it closes (at least one)."""
    return max(1, math.ceil(fraction * groups - 1e-9))


def complete_groups(items: Iterable[WorkItem], done: Mapping) -> set[str]:
    """The prompt uids whose every item's key is in `done`."""
    keys: dict[str, list] = defaultdict(list)
    for it in items:
        keys[it.prompt_uid].append(it.key)
    return {uid for uid, ks in keys.items() if all(k in done for k in ks)}


def split(items: list[WorkItem], results: Mapping, open_items: Mapping) -> tuple[list[Trajectory], Carry]:
    """A closed step's items -> (the trajectories it trains: its complete groups', in item order; the carry).
    `open_items`: the unfinished items by key, with their latest resume state."""
    done = complete_groups(items, results)
    trained = [results[it.key] for it in items if it.prompt_uid in done]
    carry = Carry()
    for it in items:
        if it.prompt_uid in done:
            continue
        if it.key in results:
            carry.finished.append(results[it.key])
        else:
            carry.items.append(open_items.get(it.key, it))
    return trained, carry


def save(paths: RunPaths, stage: str, step: int, carry: Carry) -> None:
    path = paths.rollout_carry(stage, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {
        "step": step, "items": [_item_row(it) for it in carry.items],
        "finished": [t.to_row() for t in carry.finished]}, what="partial-rollout carry")


def _item_row(it: WorkItem) -> dict:
    return {**dataclasses.asdict(it), "resume": None if it.resume is None else it.resume.to_dict()}


def _item(row: dict) -> WorkItem:
    resume = row.get("resume")
    return WorkItem(**{**row, "resume": None if resume is None else AgentResult.from_dict(resume)})


def load(paths: RunPaths, stage: str, step: int) -> Carry:
    """The carry step `step` wrote (empty if none). Call it only once that step's trajectories are committed."""
    import json

    path = paths.rollout_carry(stage, step)
    if not path.is_file():
        return Carry()
    rec = json.loads(path.read_text())
    return Carry([_item(it) for it in rec["items"]], [Trajectory.from_row(r) for r in rec["finished"]])
