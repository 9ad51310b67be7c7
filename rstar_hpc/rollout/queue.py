"""Rank 0's queue of one rollout step: its trajectories (work items), where each is booked, and their results.

FIFO: the shared admission (admission.py: `kv_aware` or `static`) places the head of the queue on an engine rank,
which keeps it for all its turns; nothing jumps the queue. Each item keeps its latest resume state (a pause, or
with partial rollouts its last turn boundary), so a trajectory re-queued after its engine is lost resumes from
there, not from the start. The loop that feeds it messages is scheduler.py's.
"""
from __future__ import annotations

import dataclasses
import logging
from collections import deque

from rstar_hpc.exchange.schema import Trajectory
from rstar_hpc.rollout.admission import Admission
from rstar_hpc.rollout.agent import AgentResult
from rstar_hpc.rollout.messages import TrajectoryResult, TurnDelta
from rstar_hpc.rollout.step import WorkItem

log = logging.getLogger("rstar_hpc.rollout")


class StepQueue:
    """The step's work items in item order (`items`: the carry first), by key with their latest state, the FIFO of
    those not admitted, and the results."""

    def __init__(self, step: int, items: list[WorkItem]):
        self.step = step
        self.items = items
        self.by_key: dict[tuple, WorkItem] = {}
        self.pending: deque[WorkItem] = deque()
        self.results: dict[tuple, Trajectory] = {}
        self.admission: Admission | None = None    # made from the HELLOs' KV capacities (open)
        self.queued_at: dict[tuple, float] = {}    # seconds into generation each item was last admitted
        self.reruns: dict[tuple, int] = {}         # items run again from their prompt (rerun_for_infra)

    def open(self, admission: Admission) -> None:
        """Book over `admission`; every item without a result waits in item order."""
        self.admission = admission
        self.by_key = {it.key: it for it in self.items}
        if len(self.by_key) != len(self.items):
            raise ValueError("duplicate (prompt_uid, sample_index) in the step's prompts; uids must be unique")
        for it in self.items:
            admission.check_fits_somewhere(len(it.prompt_ids))
        self.pending = deque(it for it in self.items if it.key not in self.results)
        self.queued_at = {it.key: 0.0 for it in self.items}

    def keep(self, finished: dict[tuple, Trajectory]) -> int:
        """Results of an earlier attempt of the step (its journal): kept, not run again; how many the step holds."""
        self.results.update({k: t for k, t in finished.items() if k in self.by_key and k not in self.results})
        return len(self.results)

    def admit(self, at_s: float) -> dict[int, list[WorkItem]]:
        """The head waits for room (rStar2: nothing jumps the queue); the admitted work by engine rank, admitted
        `at_s` seconds into generation."""
        assert self.admission is not None, "open the queue first"
        batch: dict[int, list[WorkItem]] = {}
        while self.pending:
            it = self.pending[0]
            if it.key in self.results:
                self.pending.popleft()
                continue
            e = self.admission.place(it.key, len(it.prompt_ids), group=it.prompt_uid, context=it.context_tokens)
            if e is None:
                break
            self.pending.popleft()
            self.queued_at[it.key] = at_s
            batch.setdefault(e, []).append(it)
        return batch

    def last_admit_s(self) -> float:
        return max(self.queued_at.values(), default=0.0)

    def is_open(self, res: TrajectoryResult) -> bool:
        """The result is this step's, of an item still without one (not a duplicate or a stale attempt)."""
        return res.step == self.step and res.key not in self.results and res.key in self.by_key

    def release(self, key: tuple) -> None:
        if self.admission.placed.get(key) is not None:
            self.admission.release(key)

    def paused(self, res: TrajectoryResult) -> WorkItem:
        """A paused trajectory: its state kept (a requeue after its engine's death resumes from here too)."""
        item = dataclasses.replace(self.by_key[res.key], resume=res.output)
        self.by_key[res.key] = item
        self.release(res.key)
        return item

    def rerun_for_infra(self, res: TrajectoryResult, limit: int) -> int:
        """A result with a tool call the sandbox's infrastructure lost, of an item run again fewer than `limit` times:
        the item runs again from its prompt, at the front of the queue, its result not kept. Its rerun count (0: the
        result stands)."""
        key = res.key
        if not res.output.infra_failures or self.reruns.get(key, 0) >= limit:
            return 0
        self.release(key)
        item = self.by_key[key] = dataclasses.replace(self.by_key[key], resume=None)
        self.pending.appendleft(item)
        self.reruns[key] = self.reruns.get(key, 0) + 1
        log.warning("trajectory %s/%d runs again from its prompt: the sandbox lost a tool call (rerun %d of "
                    "rollout.scheduler.infra_reruns=%d)", *key, self.reruns[key], limit)
        return self.reruns[key]

    def turn(self, src: int, delta: TurnDelta) -> None:
        """A trajectory of engine `src` passed a turn boundary: a requeue after that engine's death resumes there."""
        key, item = delta.key, self.by_key.get(delta.key)
        if item is None or delta.step != self.step or key in self.results or \
                self.admission.placed.get(key, [None])[0] != src:
            return   # a stale attempt's (the key re-runs elsewhere)
        state = delta.onto(item.resume or AgentResult(prompt_ids=list(item.prompt_ids), prompt_text=item.prompt_text))
        if state is not None:
            self.by_key[key] = dataclasses.replace(item, resume=state)

    def engine_lost(self, rank: int) -> tuple[int, int]:
        """Its unfinished trajectories back to the front of the queue, in their order: (how many, how many of them
        resume from a turn boundary or a pause)."""
        if self.admission is None:
            return 0, 0
        back = [k for k in self.admission.engine_lost(rank) if k not in self.results]
        for k in reversed(back):
            self.pending.appendleft(self.by_key[k])
        return len(back), sum(self.by_key[k].resume is not None for k in back)

    def take_waiting(self) -> list[WorkItem]:
        """Empty the FIFO: what was never admitted (or was re-queued), with its latest state (the step closed)."""
        left = [self.by_key[it.key] for it in self.pending if it.key not in self.results]
        self.pending.clear()
        return left
