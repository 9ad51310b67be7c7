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
"""
from __future__ import annotations

import dataclasses
import logging

from rstar_hpc.rollout import carry as carry_mod
from rstar_hpc.rollout.mpi import TAG_MIGRATE, TAG_PAUSE

log = logging.getLogger("rstar_hpc.rollout")


class Levers:
    """State of the levers for one step; `s` is the StepScheduler (its comm, admission, queue and results)."""

    def __init__(self, s):
        self.s, self.sc = s, s.sc
        self.migrating: dict[tuple, int] = {}     # key -> engine rank asked to let it go
        self.migrations = 0
        self.migrated_context_tokens = 0          # what the targets re-prefill (at most: less a cached prompt)
        self.migrated_keys: list[tuple] = []
        self.closing = False
        self.closed_at: float | None = None
        self.open_items: dict[tuple, object] = {}   # unfinished items carried out, with their latest state
        self.carried_in = carry_mod.Carry()

    # ------------------------------------------------------------------------------------------- carry in
    def take_carry(self) -> None:
        """Before admission: the previous step's carry goes first in this step's items."""
        if not self.sc.partial_rollouts or self.s.step == 0:
            return
        from rstar_hpc.exchange.writer import ShardWriter
        if not ShardWriter.is_committed(self.s.paths, self.s.stage, self.s.step - 1, "rollout"):
            raise RuntimeError(f"step {self.s.step} of stage {self.s.stage} runs before step {self.s.step - 1} is "
                               f"committed: with partial rollouts it resumes that step's carry, so steps run in order")
        self.carried_in = carry_mod.load(self.s.paths, self.s.stage, self.s.step - 1)
        if len(self.carried_in):
            log.info("step %d of stage %s: %d trajectories carried in (%d paused or not started, %d finished)",
                     self.s.step, self.s.stage, len(self.carried_in), len(self.carried_in.items),
                     len(self.carried_in.finished))
        fresh = {it.key for it in self.s.items}
        clash = [it.key for it in self.carried_in.items if it.key in fresh]
        if clash:
            raise ValueError(f"step {self.s.step}: prompt {clash[0][0]!r} is both carried from the step before and "
                             f"drawn again (the data wrapped around an epoch while it was carried); give the stage "
                             f"more prompts or turn rollout.scheduler.partial_rollouts off")
        self.s.items = [*self.carried_in.items, *self._finished_items(), *self.s.items]

    def _finished_items(self) -> list:
        """Work items standing for the carried-in finished trajectories (their group's membership, item order)."""
        from rstar_hpc.rollout.step import WorkItem
        return [WorkItem(t.prompt_uid, t.sample_index, list(t.prompt_ids), t.prompt_text, "")
                for t in self.carried_in.finished]

    def carried_results(self) -> dict:
        """The carried-in finished trajectories, now rows of this step."""
        return {t.key: dataclasses.replace(t, step=self.s.step) for t in self.carried_in.finished}

    # ------------------------------------------------------------------------------------------- the loop
    def over(self) -> bool:
        """Every item finished or (the step closed) carried out."""
        if not self.open_items:
            return len(self.s.results) >= len(self.s.items)
        return len(self.s.results.keys() | self.open_items.keys()) >= len(self.s.items)

    def on_beat(self, src: int, msg: dict) -> None:
        """Migration: ask `src` to let go of trajectories waiting for a tool call, where admission says so."""
        s = self.s
        if not self.sc.migrate_on_tool_call or self.closing or s.pending or s.admission.name != "kv_aware":
            return
        if src in self.migrating.values():
            return   # one at a time per engine: its booking moves only once it has left
        for key in msg.get("movable", ()):
            key = tuple(key)
            p = s.admission.placed.get(key)
            if p is None or p[0] != src:
                continue
            if s.admission.migration_target(key, self.sc.migrate_margin) is not None:
                self.migrating[key] = src
                s.sends.append(s.comm.isend({"key": key}, dest=src, tag=TAG_MIGRATE))
                return

    def on_moved(self, msg: dict) -> None:
        """MIGRATE declined: the trajectory was gone already."""
        self.migrating.pop(tuple(msg["key"]), None)

    def on_finished(self, key: tuple) -> None:
        """A trajectory asked to migrate finished first (no further tool call): nothing to move."""
        self.migrating.pop(key, None)

    def on_paused(self, res) -> None:
        """A paused trajectory came back with its state: carried out (step closing) or admitted again (migration)."""
        s = self.s
        key = res.key
        if res.step != s.step or key in s.results or key not in s.by_key:
            return
        item = dataclasses.replace(s.by_key[key], resume=res.output)
        s.by_key[key] = item   # a requeue after an engine death resumes from here too
        if s.admission.placed.get(key) is not None:
            s.admission.release(key)
        migrated = self.migrating.pop(key, None) is not None
        if self.closing:
            self.open_items[key] = item
            return
        if migrated:
            self.migrations += 1
            self.migrated_context_tokens += item.context_tokens
            self.migrated_keys.append(key)
        s.pending.appendleft(item)

    def after_result(self) -> None:
        """Partial rollouts: close the step once enough of its groups are complete."""
        s = self.s
        if not self.sc.partial_rollouts or self.closing:
            return
        groups = len({it.prompt_uid for it in s.items})
        if len(carry_mod.complete_groups(s.items, s.results)) >= carry_mod.close_threshold(
                groups, self.sc.partial_close_fraction):
            self.close()

    def close(self) -> None:
        s = self.s
        self.closing = True
        self.closed_at = s.elapsed()
        s.sends += [s.comm.isend(None, dest=e, tag=TAG_PAUSE) for e in s.alive]
        self.drain_pending()
        log.info("step %d of stage %s closes (partial rollouts): %d of %d trajectories done", s.step, s.stage,
                 len(s.results), len(s.items))

    def drain_pending(self) -> None:
        """Closing: what was never admitted (or was re-queued) is carried as it is."""
        s = self.s
        while s.pending:
            it = s.pending.popleft()
            if it.key not in s.results:
                self.open_items[it.key] = s.by_key[it.key]

    # ------------------------------------------------------------------------------------------- the end
    def commit_split(self) -> list:
        """The trajectories the step trains; with partial rollouts the carry is saved first (carry.py)."""
        s = self.s
        if not self.sc.partial_rollouts:
            return [s.results[it.key] for it in s.items]
        trained, out = carry_mod.split(s.items, s.results, self.open_items)
        carry_mod.save(s.paths, s.stage, s.step, out)
        self.carried_out = len(out)
        return trained

    def metrics(self) -> dict:
        out = {}
        if self.sc.migrate_on_tool_call:
            out.update(migrations=self.migrations, migrated_context_tokens=self.migrated_context_tokens,
                       migrated=[list(k) for k in self.migrated_keys[:100]])
        if self.sc.partial_rollouts:
            out.update(carried_in=len(self.carried_in), carried_out=getattr(self, "carried_out", 0),
                       closed_at_s=None if self.closed_at is None else round(self.closed_at, 3))
        return out
