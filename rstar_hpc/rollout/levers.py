"""Rank 0's long-tail levers (bench/rollout_balance.py measures them): turn-boundary migration and
partial rollouts, each a rollout.scheduler knob, off by default.

Migration (`migrate_on_tool_call`): engine ranks list in their heartbeats the trajectories that may move
(`movable`: those waiting for a tool call first). Once the step's queue is empty, rank 0 asks admission
(admission.migration_target: the same KV accounting as admitting) whether another engine should take one's next
turn, one per engine at a time (its booking moves only once it has left); if so it sends MIGRATE to its
engine, which pauses it at its next turn boundary (its tool result appended) and returns it as a paused RESULT with
its agent-loop state (MOVED: it was gone already). One that finishes without another tool call just finishes. Rank 0
releases its booking and admits it again at the front of the queue, now as the context it has: admission places it
where there is most room, and the engine there re-prefills its context (a sibling's prompt from its prefix cache).

Partial rollouts (`partial_rollouts`): after each result, once `partial_close_fraction` of the step's groups are
complete the step closes: PAUSE to every engine rank, nothing more is admitted, and every live trajectory comes
back finished or paused. The step then trains its complete groups and carries the rest (carry.py).

`Levers` decides; StepScheduler (scheduler.py) acts. Each method takes what it reads (the step's items, results,
admission) and returns a decision: the carried-in items and results, the key to MIGRATE, REQUEUE or CARRY for a
paused trajectory, whether to close, the trained/carried split. The scheduler sends the messages, edits its
queue and releases the bookings.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Iterable, Mapping, Sequence

from rstar_hpc.config.rollout import SchedulerConfig
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.schema import Trajectory
from rstar_hpc.rollout import carry as carry_mod
from rstar_hpc.rollout.admission import Admission
from rstar_hpc.rollout.step import WorkItem

log = logging.getLogger("rstar_hpc.rollout")


class Route(enum.Enum):
    """What becomes of a paused trajectory back at rank 0 (Levers.paused)."""
    REQUEUE = "requeue"   # migration: admitted again, at the front of the queue
    CARRY = "carry"       # the step closed: carried into the next step as it is


class Levers:
    """The levers' state for one step. The methods take what they read and return decisions; the scheduler applies
    them (its sends, queue and admission bookings): nothing here touches MPI or the scheduler's state."""

    def __init__(self, sc: SchedulerConfig):
        self.sc = sc
        self.migrating: dict[tuple, int] = {}        # key -> engine rank asked to let it go
        self.migrations = 0
        self.migrated_context_tokens = 0             # what the targets re-prefill (at most: less a cached prompt)
        self.migrated_keys: list[tuple] = []
        self.closing = False                         # partial rollouts: the step closed, nothing more is admitted
        self.closed_at: float | None = None
        self.open_items: dict[tuple, WorkItem] = {}  # unfinished items carried out, with their latest state
        self.carried_in = carry_mod.Carry()
        self.carried_out = 0

    # ------------------------------------------------------------------------------------------- carry in
    def carry_in(self, paths: RunPaths, stage: str, step: int,
                 items: Sequence[WorkItem]) -> tuple[list[WorkItem], dict[tuple, Trajectory]]:
        """Before admission: the step's items with the previous step's carry first, and the carried-in finished
        trajectories, now rows of this step (the scheduler's first results)."""
        if not self.sc.partial_rollouts or step == 0:
            return list(items), {}
        from rstar_hpc import pipeline
        from rstar_hpc.exchange.writer import ShardWriter
        if not ShardWriter.is_committed(paths, stage, step - 1, pipeline.PRODUCER):
            raise RuntimeError(f"step {step} of stage {stage} runs before step {step - 1} is committed: with partial "
                               f"rollouts it resumes that step's carry, so steps run in order")
        self.carried_in = c = carry_mod.load(paths, stage, step - 1)
        if len(c):
            log.info("step %d of stage %s: %d trajectories carried in (%d paused or not started, %d finished)",
                     step, stage, len(c), len(c.items), len(c.finished))
        fresh = {it.key for it in items}
        clash = [it.key for it in c.items if it.key in fresh]
        if clash:
            raise ValueError(f"step {step}: prompt {clash[0][0]!r} is both carried from the step before and drawn "
                             f"again (the data wrapped around an epoch while it was carried); give the stage more "
                             f"prompts or turn rollout.scheduler.partial_rollouts off")
        # work items standing for the finished ones: their group's membership, item order
        finished = [WorkItem(t.prompt_uid, t.sample_index, list(t.prompt_ids), t.prompt_text, "") for t in c.finished]
        return [*c.items, *finished, *items], {t.key: dataclasses.replace(t, step=step) for t in c.finished}

    # ------------------------------------------------------------------------------------------- the loop
    def over(self, items: Sequence[WorkItem], results: Mapping) -> bool:
        """Every item finished or (the step closed) carried out."""
        if not self.open_items:
            return len(results) >= len(items)
        return len(results.keys() | self.open_items.keys()) >= len(items)

    def migration(self, src: int, movable: Iterable, admission: Admission, *, queue_empty: bool) -> tuple | None:
        """A KV beat from `src`: the trajectory to ask it to let go of (MIGRATE), where admission says another
        engine should take its next turn; None: none. Only in the step's tail (its queue empty), one at a time per
        engine (its booking moves only once it has left)."""
        if not self.sc.migrate_on_tool_call or self.closing or not queue_empty or admission.name != "kv_aware":
            return None
        if src in self.migrating.values():
            return None
        for key in movable:
            key = tuple(key)
            p = admission.placed.get(key)
            if p is None or p[0] != src:
                continue
            if admission.migration_target(key, self.sc.migrate_margin) is not None:
                self.migrating[key] = src
                return key
        return None

    def on_moved(self, key: tuple) -> None:
        """MIGRATE declined: the trajectory was gone already."""
        self.migrating.pop(key, None)

    def on_finished(self, key: tuple) -> None:
        """A trajectory asked to migrate finished first (no further tool call): nothing to move."""
        self.migrating.pop(key, None)

    def paused(self, key: tuple, item: WorkItem) -> Route:
        """A paused trajectory came back (`item.resume`: its state; its booking released): carried out if the
        step is closing, else (migration) admitted again."""
        migrated = self.migrating.pop(key, None) is not None
        if self.closing:
            self.open_items[key] = item
            return Route.CARRY
        if migrated:
            self.migrations += 1
            self.migrated_context_tokens += item.context_tokens
            self.migrated_keys.append(key)
        return Route.REQUEUE

    def should_close(self, items: Sequence[WorkItem], results: Mapping) -> bool:
        """Partial rollouts: True once enough of the step's groups are complete (the step closes now)."""
        if not self.sc.partial_rollouts or self.closing:
            return False
        groups = len({it.prompt_uid for it in items})
        done = carry_mod.complete_groups(items, results)
        return len(done) >= carry_mod.close_threshold(groups, self.sc.partial_close_fraction)

    def close(self, at_s: float) -> None:
        """The step closes `at_s` seconds into generation (the scheduler sends PAUSE and carries its queue)."""
        self.closing, self.closed_at = True, at_s

    def carry_queued(self, items: Iterable[WorkItem]) -> None:
        """Closing: items never admitted (or re-queued) are carried as they are."""
        for it in items:
            self.open_items[it.key] = it

    # ------------------------------------------------------------------------------------------- the end
    def split(self, items: Sequence[WorkItem], results: Mapping) -> tuple[list[Trajectory], carry_mod.Carry | None]:
        """The trajectories the step trains, in item order, and (partial rollouts) the carry, which the scheduler
        saves BEFORE it commits them (carry.py)."""
        if not self.sc.partial_rollouts:
            return [results[it.key] for it in items], None
        trained, out = carry_mod.split(list(items), results, self.open_items)
        self.carried_out = len(out)
        return trained, out

    def metrics(self) -> dict:
        out = {}
        if self.sc.migrate_on_tool_call:
            out.update(migrations=self.migrations, migrated_context_tokens=self.migrated_context_tokens,
                       migrated=[list(k) for k in self.migrated_keys[:100]])
        if self.sc.partial_rollouts:
            out.update(carried_in=len(self.carried_in), carried_out=self.carried_out,
                       closed_at_s=None if self.closed_at is None else round(self.closed_at, 3))
        return out
