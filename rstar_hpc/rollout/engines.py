"""What rank 0 knows of an engine rank: its state in a step (Engine), why a step lost it (Lost), and what the job
keeps between steps (JobEngines). The roster (roster.py) moves engines between the states.

An engine is judged by progress, not presence. Its state:

    starting     START sent; it acks at once, then loads the step's policy and warms up, reporting as it goes
    ready        it said HELLO (its KV capacity): admission may place work on it. The step begins once every engine
                 is ready or lost, or `late_join_after_s` after the first HELLO: a slow loader then joins the running
                 step when it says HELLO, so one slow or stuck load holds up no one (policy_load_timeout_s bounds
                 it); one still loading when the step ends carries its load's clock into the next (JobEngines)
    generating   its last report had requests inside its vLLM engine
    hung         its requests made no token for `engine_stall_s` while its rank went on reporting (a vLLM engine
                 core stuck in a kernel or a collective), or it reported through a start longer than
                 policy_load_timeout_s: dropped like a dead one, told to leave, and its keeper told to kill it whole
                 (rollout/keeper.py), so it starts again with a fresh engine core
    dead         its rank said DEAD, its keeper reported its process dead (links.py), or it was silent for
                 `engine_timeout_s` (starting or not: a loading engine reports too; a silent process that lives on
                 is killed and restarted by its keeper too)

A trajectory waiting for its tool is not generating: an engine whose every trajectory waits on the sandbox is
idle, not hung (the sandbox's own timeout bounds that wait). Progress is the engine's token counter (vLLM's
iteration stats: prompt tokens prefilled and tokens generated), which stops when its engine core stops.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Engine:
    """One engine rank as rank 0 sees it in this step."""
    rank: int
    state: str = "starting"
    heard_at: float = field(default_factory=lambda: time.monotonic())    # any message
    moved_at: float = field(default_factory=lambda: time.monotonic())    # its token counter last moved, or it had nothing
    acked_at: float | None = None                               # START acked: loading its policy
    tokens: int | None = None                                   # its token counter at its last report
    generating: int = 0                                         # requests inside its vLLM engine at its last report
    doing: str = ""                                             # what a starting engine said it is doing

    @property
    def in_step(self) -> bool:
        return self.state not in ("dead", "hung")

    def view(self, now: float) -> dict:
        """For the role's heartbeat (`run status`): its state and how long since it last moved."""
        out = {"state": self.state, "moved_s_ago": round(now - self.moved_at, 1)}
        return {**out, "doing": self.doing} if self.doing and self.state == "starting" else out


@dataclass(frozen=True)
class Lost:
    """An engine the step lost, and why; `hung`: alive but not moving (its keeper is told to restart it);
    `starting`: lost before it said HELLO."""
    rank: int
    why: str
    hung: bool = False
    starting: bool = False


@dataclass
class JobEngines:
    """What the job knows of its engine ranks between steps (rank 0's RolloutJob holds it; each step's roster
    updates it in place)."""
    dead: set[int] = field(default_factory=set)
    """Lost in an earlier step, until its keeper's new process joins again (RolloutJob.refresh_engines)."""
    versions: dict[int, int | None] = field(default_factory=dict)
    """The policy version each engine runs (its HELLOs)."""
    loading: dict[int, float] = field(default_factory=dict)
    """Still loading when a step ended: since when (time.monotonic), so the load bound spans the steps it takes."""
