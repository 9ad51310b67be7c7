"""The typed trajectory messages: what an engine rank sends rank 0 for each trajectory it ran (mpi.py's RESULT),
and, with partial rollouts, at each of its turn boundaries (mpi.py's TURN: `TurnDelta`).

    engine rank: AgentLoop.run -> AgentResult ─▶ TrajectoryResult ══ MPI (pickled as it is) ══▶ rank 0
    rank 0: finished -> Scorer(item, result) -> exchange Trajectory -> journal part, then the step's commit
            paused   -> item.resume = result.output -> admitted again (migration) or carried (carry.py)

Nothing converts it on the way: mpi4py pickles the dataclass, the Scorer reads its fields, and a paused
trajectory's `output` is the very state its next engine resumes. Only the carry file holds it as JSON
(`AgentResult.to_dict` / `from_dict`). One name per field end to end: `token_policy_versions` is the exchange
schema's column.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rstar_hpc.exchange.schema import ToolCall, Turn
from rstar_hpc.rollout.agent import AgentResult


@dataclass
class TrajectoryResult:
    """One trajectory an engine rank ran in a step, finished or paused (`output.paused`)."""
    prompt_uid: str
    sample_index: int
    step: int
    """The step it ran in: rank 0 ignores another step's late result."""
    engine_rank: int
    policy_version: int | None
    """The policy the engine ran when it ended (its tokens' own versions: output.token_policy_versions)."""
    output: AgentResult
    """What the agent loop produced; for a paused trajectory, the state to resume."""

    @property
    def key(self) -> tuple[str, int]:
        return (self.prompt_uid, self.sample_index)

    @property
    def paused(self) -> bool:
        return self.output.paused


@dataclass
class TurnDelta:
    """A trajectory passed a turn boundary (its tool results appended): what it added since its last delta, or
    since the state it was admitted with. Rank 0 appends it to that state (`onto`), so when the engine dies the
    trajectory is requeued from its latest boundary; sending only what is new keeps the traffic one trajectory's
    tokens, however many turns it takes."""
    prompt_uid: str
    sample_index: int
    step: int
    start: int                        # response tokens the state had before this delta
    turns_before: int                 # turns and tool calls it had before
    calls_before: int
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    token_policy_versions: list[int]
    turns: list[Turn]
    tool_calls: list[ToolCall]
    num_cached_tokens: int            # totals, not increments
    infra_failures: int

    @property
    def key(self) -> tuple[str, int]:
        return (self.prompt_uid, self.sample_index)

    @staticmethod
    def sizes(res: AgentResult) -> tuple[int, int, int]:
        """Where a state ends: (response tokens, turns, tool calls); a delta continues a state that ends where it
        starts."""
        return len(res.response_ids), len(res.turns), len(res.tool_calls)

    @classmethod
    def since(cls, res: AgentResult, key: tuple[str, int], step: int, sent: tuple[int, int, int]) -> TurnDelta:
        """What `res` added after `sent`, the `sizes` of the state the last delta (or the admission) left."""
        n, t, c = sent
        return cls(key[0], key[1], step, n, t, c, res.response_ids[n:], res.loss_mask[n:], res.logprobs[n:],
                   res.token_policy_versions[n:], res.turns[t:], res.tool_calls[c:], res.num_cached_tokens,
                   res.infra_failures)

    def onto(self, state: AgentResult) -> AgentResult | None:
        """`state` with this delta appended, as a paused trajectory at the boundary (what `AgentLoop.run` resumes);
        None when the delta does not continue `state` (a stale one of an earlier attempt)."""
        if self.sizes(state) != (self.start, self.turns_before, self.calls_before):
            return None
        return dataclasses.replace(
            state, response_ids=state.response_ids + self.response_ids, loss_mask=state.loss_mask + self.loss_mask,
            logprobs=state.logprobs + self.logprobs,
            token_policy_versions=state.token_policy_versions + self.token_policy_versions,
            turns=state.turns + self.turns, tool_calls=state.tool_calls + self.tool_calls,
            num_cached_tokens=self.num_cached_tokens, infra_failures=self.infra_failures,
            timings=dataclasses.replace(state.timings), paused=True, open_turn=False, pending_tool=False)
