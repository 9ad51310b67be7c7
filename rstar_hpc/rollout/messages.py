"""The one typed trajectory message: what an engine rank sends rank 0 for each trajectory it ran (mpi.py's RESULT).

    engine rank: AgentLoop.run -> AgentResult ─▶ TrajectoryResult ══ MPI (pickled as it is) ══▶ rank 0
    rank 0: finished -> Scorer(item, result) -> exchange Trajectory -> journal part, then the step's commit
            paused   -> item.resume = result.output -> admitted again (migration) or carried (carry.py)

Nothing converts it on the way: mpi4py pickles the dataclass, the Scorer reads its fields, and a paused
trajectory's `output` is the very state its next engine resumes. Only the carry file holds it as JSON
(`AgentResult.to_dict` / `from_dict`). One name per field end to end: `token_policy_versions` is the exchange
schema's column.
"""
from __future__ import annotations

from dataclasses import dataclass

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
