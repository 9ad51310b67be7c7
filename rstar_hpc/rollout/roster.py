"""Rank 0's engines in one step: who takes part, what each is doing, and whether it is moving.

Each engine is judged by progress, not presence (engines.py names its states: starting, ready, generating, hung,
dead). The step begins when every engine is ready or lost, or `late_join_after_s` after the first HELLO; a slow
loader joins the running step with its HELLO.

Words: the engines' *report* (tag KV, every heartbeat_s: KV booking, movable trajectories, progress) and rank 0's
*keep-alive* (tag ALIVE, every heartbeat_s: an engine rank that hears nothing from rank 0 leaves). The role's
*heartbeat* is the file `run status` reads (step.StepHooks.heartbeat), not this module's.

The roster never touches the step's queue: `check`, `start` and `finish` return what they lost (`Lost`), and the
scheduler re-queues those engines' work.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from rstar_hpc.config.rollout import SchedulerConfig
from rstar_hpc.rollout.engines import Engine, JobEngines, Lost
from rstar_hpc.rollout.mpi import (TAG_ABORT, TAG_ACK, TAG_ALIVE, TAG_DEAD, TAG_DONE, TAG_HELLO, TAG_KV, TAG_START,
                                   TAG_STATS, wait_sent)

log = logging.getLogger("rstar_hpc.rollout")
REPORTING = 3   # heard within this many heartbeat_s: the engine's rank still reports


class EngineRoster:
    """The engines of one step, and the job's record of them (`job`, updated in place)."""

    def __init__(self, comm, MPI, sc: SchedulerConfig, *, job: JobEngines | None = None):
        self.comm, self.MPI, self.sc = comm, MPI, sc
        self.job = job if job is not None else JobEngines()
        self.engines: dict[int, Engine] = {}
        self.step_of: tuple | None = None         # (stage, step): an ACK or HELLO of another step is a leftover
        self.lost: list[Lost] = []                # this step's
        self.sends: list = []                     # non-blocking sends in flight
        self.alive_sent_at = 0.0

    # --------------------------------------------------------------------------------------------- who
    def candidates(self, what: str) -> list[int]:
        """The job's engine ranks not lost before this step."""
        ranks = [e for e in range(1, self.comm.Get_size()) if e not in self.job.dead]
        if not ranks:
            raise RuntimeError(f"no engine rank can run {what}: of {self.comm.Get_size() - 1}, these died or never "
                               f"joined: {sorted(self.job.dead)}")
        return ranks

    def live(self) -> list[int]:
        return [e for e, s in self.engines.items() if s.in_step]

    def ready(self) -> list[int]:
        """In the step and past its HELLO: admission may place work on it."""
        return [e for e, s in self.engines.items() if s.state in ("ready", "generating")]

    def in_step(self, rank: int) -> bool:
        s = self.engines.get(rank)
        return s is not None and s.in_step

    def starting(self, rank: int) -> bool:
        s = self.engines.get(rank)
        return s is not None and s.state == "starting"

    def moved_at(self) -> float:
        """When any engine in the step last moved (0.0: none is in it)."""
        return max((self.engines[e].moved_at for e in self.live()), default=0.0)

    def views(self) -> dict[str, dict]:
        now = time.monotonic()
        return {str(e): s.view(now) for e, s in sorted(self.engines.items())}

    # --------------------------------------------------------------------------------------------- messages
    def send(self, rank: int, tag: int, msg=None) -> None:
        # never a blocking send: a large message to a rank that just died would wait forever (rendezvous)
        self.sends.append(self.comm.isend(msg, dest=rank, tag=tag))
        self.sends[:] = [r for r in self.sends if not r.Test()]

    def broadcast(self, tag: int, msg=None, ranks: list[int] | None = None) -> None:
        for e in self.live() if ranks is None else ranks:
            self.send(e, tag, msg)

    def drain(self) -> None:
        """Before rank 0 leaves: let the engines take what was sent. A message past Open MPI's eager limit (a WORK
        batch of two long prompts) is read from the sender's memory; if rank 0 has exited by then the engine rank's
        read fails and it hangs, and so does the job (seen: Ctrl-C right after a WORK send)."""
        if not wait_sent(self.sends, min(self.sc.engine_timeout_s, 10.0)):
            log.warning("engine ranks did not take %d messages before rank 0 stopped", len(self.sends))

    def keep_alive(self, ranks: list[int] | None = None) -> None:
        """ALIVE every heartbeat_s to `ranks` (default: the ready ones): engines leave when rank 0 goes silent. A
        loader reads nothing until its HELLO, so it is sent none."""
        now = time.monotonic()
        if now - self.alive_sent_at > self.sc.heartbeat_s:
            self.broadcast(TAG_ALIVE, None, self.ready() if ranks is None else ranks)
            self.alive_sent_at = now

    def heard(self, rank: int, moved: bool = False) -> bool:
        """A message of `rank` arrived (`moved`: a result or a turn, progress by itself); False if it is no longer
        in the step (declared lost while only slow: its work already runs elsewhere)."""
        if not self.in_step(rank):
            return False
        s = self.engines[rank]
        s.heard_at = time.monotonic()
        if moved:
            s.moved_at = s.heard_at
        return True

    def on_report(self, rank: int, report: dict) -> None:
        """An engine's report (tag KV): its progress counter moved, or it has nothing inside its engine; a starting
        one's says what it does (its load moves)."""
        s = self.engines[rank]
        if "starting" in report:
            if s.state == "starting":
                s.doing = report["starting"]
            return
        now = time.monotonic()
        tokens, s.generating = report.get("tokens"), int(report.get("generating", 0))
        if tokens is None or tokens != s.tokens or not s.generating:
            s.moved_at = now
        s.tokens = tokens
        if s.state in ("ready", "generating"):
            s.state = "generating" if s.generating else "ready"

    # --------------------------------------------------------------------------------------------- start
    def start(self, ranks: list[int], start: dict, heartbeat: Callable[[str], None]) -> tuple[dict[int, dict],
                                                                                             list[Lost]]:
        """START to `ranks`; the HELLOs by rank of those ready when the step begins, and those lost on the way. An
        engine acks at once, then loads the step's policy (within policy_load_timeout_s of its ack) and reports while
        it does; one that says DEAD, whose process dies, or that goes silent for engine_timeout_s is lost at once,
        not after the load's bound. The step begins when none is starting, or `late_join_after_s` after the first
        HELLO: those still loading stay `starting` and join it later (on_hello)."""
        self.engines = {e: Engine(e, acked_at=self.job.loading.pop(e, None)) for e in ranks}
        self.step_of = (start.get("stage"), start.get("step"))
        before = len(self.lost)   # lost while the step waited for its policy (judge_loads): returned then
        self.broadcast(TAG_START, start)
        hello: dict[int, dict] = {}
        first_ready: float | None = None
        st = self.MPI.Status()
        while any(s.state == "starting" for s in self.engines.values()):
            now = time.monotonic()
            if first_ready is not None and now - first_ready >= self.sc.late_join_after_s:
                late = [e for e, s in self.engines.items() if s.state == "starting"]
                log.warning("step %s of stage %s begins with engine rank(s) %s ready; %s still starting join it when "
                            "ready (rollout.scheduler.late_join_after_s=%g)", *self.step_of[::-1],
                            sorted(hello), late, self.sc.late_join_after_s)
                break
            self._time_out_starts()
            if self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=self.MPI.ANY_TAG, status=st):
                src, tag = st.Get_source(), st.Get_tag()
                msg = self.comm.recv(source=src, tag=tag)
                s = self.engines.get(src)
                if s is None or not s.in_step:
                    continue   # one lost already
                s.heard_at = time.monotonic()   # a ready engine reports while it waits for the slow loaders
                if tag == TAG_DEAD:   # a ready one's death too: not found only by its silence later
                    self.lose(src, str(msg))
                    hello.pop(src, None)
                elif s.state != "starting":
                    continue   # nothing else of a ready one counts yet
                elif tag == TAG_HELLO and self.on_hello(src, msg):
                    hello[src] = msg
                    first_ready = s.heard_at if first_ready is None else first_ready
                elif tag == TAG_ACK:
                    self.on_ack(src, msg)
                elif tag == TAG_KV:
                    self.on_report(src, msg)
            else:
                time.sleep(0.005)
            heartbeat(f"starting {len(ranks)} engine(s), {len(hello)} ready")
            self.keep_alive(list(hello))   # engines that are ready wait for the slow loaders
        if not hello:
            raise RuntimeError(f"no engine rank started: {'; '.join(f'{x.rank}: {x.why}' for x in self.lost)}")
        return hello, self.lost[before:]

    def _this_step(self, msg) -> bool:
        """An ACK or HELLO of this step (one of an earlier step, from a loader that finished it late, is not)."""
        return not isinstance(msg, dict) or "step" not in msg or (msg.get("stage"), msg["step"]) == self.step_of

    def on_ack(self, rank: int, msg: dict) -> None:
        """START acked: the engine loads the step's policy (or only warms up), from now within the load bound."""
        s = self.engines[rank]
        if s.state == "starting" and self._this_step(msg):
            s.acked_at, s.doing = time.monotonic(), "loading the policy" if msg.get("loading") else "warming up"

    def on_hello(self, rank: int, msg: dict) -> bool:
        """HELLO: a starting engine is ready (True); a leftover of an earlier step is not."""
        s = self.engines[rank]
        if s.state != "starting" or not self._this_step(msg):
            return False
        s.state, s.moved_at, s.doing = "ready", time.monotonic(), ""
        return True

    def _time_out_starts(self) -> list[Lost]:
        now, sc, lost = time.monotonic(), self.sc, []
        for s in [s for s in self.engines.values() if s.state == "starting"]:
            if now - s.heard_at > sc.engine_timeout_s:
                lost.append(self.lose(s.rank, f"silent for {now - s.heard_at:.0f}s while starting"
                                      + (f" ({s.doing})" if s.doing else " (no answer to START)"), restart=True))
            elif s.acked_at is not None and now - s.acked_at > sc.policy_load_timeout_s:   # reports, never ready
                lost.append(self.lose(s.rank, f"hung: still {s.doing or 'starting'} {now - s.acked_at:.0f}s after "
                                      f"START (rollout.scheduler.policy_load_timeout_s={sc.policy_load_timeout_s:g})",
                                      hung=True))
        return lost

    def judge_loads(self) -> list[Lost]:
        """Between steps: engines still loading an earlier step's policy (job.loading) past policy_load_timeout_s
        are hung; lost now (their keepers kill and restart them), so they are out of the next step."""
        now, bound, lost = time.monotonic(), self.sc.policy_load_timeout_s, []
        for rank, since in [(r, t) for r, t in self.job.loading.items() if now - t > bound]:
            del self.job.loading[rank]
            self.engines[rank] = Engine(rank)   # starting: so the Lost says it never got ready
            lost.append(self.lose(rank, f"hung: still loading the policy {now - since:.0f}s after START "
                                        f"(rollout.scheduler.policy_load_timeout_s={bound:g})", hung=True))
            self.job.dead.add(rank)
        return lost

    # --------------------------------------------------------------------------------------------- judgment
    def check(self) -> list[Lost]:
        """Keep-alive, then judge every engine in the step: silent for engine_timeout_s, or holding requests in its
        engine that made no token for engine_stall_s. What it lost now."""
        self.keep_alive()
        lost = self._time_out_starts()   # a late joiner
        now, sc = time.monotonic(), self.sc
        for s in [self.engines[e] for e in self.ready()]:
            if now - s.heard_at > sc.engine_timeout_s:
                lost.append(self.lose(s.rank, f"silent for {now - s.heard_at:.0f}s", restart=True))
            elif s.generating and now - s.moved_at > sc.engine_stall_s and now - s.heard_at <= REPORTING * sc.heartbeat_s:
                # hung only while it still reports: one that stopped reporting is left to the silence rule (a lost
                # task's engine is dead, not hung)
                lost.append(self.lose(s.rank, f"hung: {s.generating} request(s) in its engine made no token for "
                                              f"{now - s.moved_at:.0f}s (its rank still reports; "
                                              f"rollout.scheduler.engine_stall_s={sc.engine_stall_s:g})", hung=True))
        return lost

    def lose(self, rank: int, why: str, hung: bool = False, restart: bool = False) -> Lost:
        """Drop `rank` from the step. One that is alive but not moving (`hung`: it reports) or gone silent
        (`restart`: its process may live on, stuck) has its keeper told to kill it whole and start it again
        (links.request_restart, by pid: a process that died meanwhile is reported and restarted anyway); a hung one
        is also told to leave (ABORT). One that said DEAD, or whose keeper reported its death, is left to its keeper."""
        s = self.engines.setdefault(rank, Engine(rank))
        starting, s.state = s.state == "starting", "hung" if hung else "dead"
        if hung:
            self.send(rank, TAG_ABORT, f"rank 0 judged engine rank {rank} {why}")
        request = getattr(self.comm, "request_restart", None)   # links.RankZeroLinks; a plain MPI comm has none
        if (hung or restart) and request is not None:
            request(rank, why)
        out = Lost(rank, why, hung, starting)
        self.lost.append(out)
        return out

    # --------------------------------------------------------------------------------------------- the end
    def finish(self, step: int) -> tuple[dict[int, dict], list[Lost]]:
        """DONE to every engine in the step; the ready ones' figures by rank, and those lost meanwhile. One that
        does not answer within engine_timeout_s is presumed dead: its results are all in, the next step goes on
        without it. One still loading answers once loaded (the next step's start drops that leftover) and keeps its
        load's clock (job.loading). Every engine lost in the step joins the job's `dead`."""
        comm, MPI = self.comm, self.MPI
        self.broadcast(TAG_DONE)
        for e, s in self.engines.items():
            if s.state == "starting":
                self.job.loading[e] = s.acked_at if s.acked_at is not None else time.monotonic()
        stats: dict[int, dict] = {}
        lost: list[Lost] = []
        deadline = time.monotonic() + self.sc.engine_timeout_s
        st = MPI.Status()
        while len(stats) < len(self.ready()) and time.monotonic() < deadline:
            if comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_STATS, status=st):
                got = comm.recv(source=st.Get_source(), tag=TAG_STATS)
                if got.get("step", step) == step and st.Get_source() in self.ready():   # not a late loader's leftover
                    stats[st.Get_source()] = got
            elif comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_DEAD, status=st):   # died as the step ended: no wait
                why = comm.recv(source=st.Get_source(), tag=TAG_DEAD)
                if self.in_step(st.Get_source()) and st.Get_source() not in stats:
                    lost.append(self.lose(st.Get_source(), str(why)))
            else:
                time.sleep(0.005)
        for e in self.ready():
            if e not in stats:
                lost.append(self.lose(e, f"no figures at the end of step {step}; presumed dead", restart=True))
        self.job.dead.update(x.rank for x in self.lost)
        return stats, lost
