"""Rank 0 of a rollout step: the loop that admits, collects and commits the step's trajectories.

    rstar-hpc rollout --config tiny-cpu --engines 2 --step 0       # or one srun task per rank under Slurm

The step's parts, each its own module: the engines (engines.py: their states; roster.py: who takes part, keep-alive,
whether each moves; it returns what it lost), the queue (queue.py: the work items, their bookings and latest states,
the results), the tally (tally.py: the clock, counters and summary), the long-tail levers (levers.py: decisions to
migrate, carry, close), and this loop, which moves messages between them. Data flows back as return values: nothing
calls back into the loop. `StepScheduler.run` reads top-down as the step's stages, which docs/architecture.md draws
as a state diagram:

    start      wait for the step's policy (policy_source.py); START the engines (each loads it, reports, says HELLO
               with its KV); begin when all are ready, or late_join_after_s after the first (the rest join later)
    admit      the queue's FIFO: admission (admission.py) places its head on an engine for all its turns
    dispatch   each engine's admitted work (never a blocking send)
    collect    results (scored off the generation path), reports (KV booking, progress), turn boundaries, deaths,
               late HELLOs; every `journal_every_s` new results go to a journal part, so a restart reruns only the rest
    check      the roster's keep-alive and judgment: a silent or hung engine is lost and its work re-queued at the
               front, from its last turn boundary or pause where kept (a late result of a re-run one is ignored)
    finish     DONE; each engine answers with its figures
    commit     all trajectories, in item order, in ONE committed shard set, then the journal parts go: readers see
               a step whole or not at all; the summary to metrics/rollout.jsonl

Tool calls are not dispatched here: each engine rank runs its trajectories as agent-loop coroutines (agent.py)
that call the sandbox service themselves, so a trajectory waiting for its tool never holds up generation. The
messages are mpi.py's; the engine ranks' side is engine_rank.py.
"""
from __future__ import annotations

import logging
import time

from rstar_hpc import pipeline
from rstar_hpc.config.rollout import SchedulerConfig
from rstar_hpc.exchange.events import record_event
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.schema import Trajectory
from rstar_hpc.exchange.writer import ShardWriter
from rstar_hpc.rollout import carry as carry_mod
from rstar_hpc.rollout.admission import admission_for
from rstar_hpc.rollout.engines import JobEngines, Lost
from rstar_hpc.rollout.journal import Journal
from rstar_hpc.rollout.levers import Levers, Route
from rstar_hpc.rollout.messages import TrajectoryResult
from rstar_hpc.rollout.mpi import (TAG_ACK, TAG_DEAD, TAG_HELLO, TAG_KV, TAG_MIGRATE, TAG_MOVED, TAG_PAUSE, TAG_RESULT,
                                   TAG_SKIP, TAG_TURN, TAG_WORK)
from rstar_hpc.rollout.policy_source import MEMORY, StepWeights, wait_for_policy
from rstar_hpc.rollout.queue import StepQueue
from rstar_hpc.rollout.roster import EngineRoster
from rstar_hpc.rollout.step import Scorer, StepHooks, StepSpec, WorkItem
from rstar_hpc.rollout.tally import StepTally

log = logging.getLogger("rstar_hpc.rollout")


class StopRequested(Exception):
    """Slurm's pre-timeout USR2 or a TERM reached rank 0: the step's finished trajectories are in its journal."""


class StepScheduler:
    """Rank 0's side of one step. `engines`: what the job knows of its engine ranks (lost ones, their policy
    versions, loads still running), updated in place; `engine_workers`: the vLLM workers of an engine (its
    tensor-parallel size)."""

    def __init__(self, comm, MPI, sc: SchedulerConfig, paths: RunPaths, spec: StepSpec, *, score: Scorer,
                 hooks: StepHooks | None = None, engines: JobEngines | None = None, engine_workers: int = 1):
        self.sc, self.paths, self.spec, self.score = sc, paths, spec, score
        self.stage, self.step = spec.stage, spec.step
        self.hooks = hooks or StepHooks()
        self.roster = EngineRoster(comm, MPI, sc, job=engines)
        self.weights = StepWeights(paths, spec.stage, spec.step, spec.need, engine_workers, self.roster.job.versions)
        self.tally = StepTally(spec.stage, spec.step, dropped=list(spec.dropped))
        self.queue = StepQueue(spec.step, list(spec.items))
        self.levers = Levers(sc)
        self.journal = Journal(paths, spec.stage, spec.step, sc.journal_every_s)
        self.beat_moved = 0.0   # the engines' progress the last heartbeat reported

    def run(self) -> dict:
        """The step, stage by stage; returns its summary (also appended to metrics/rollout.jsonl)."""
        engines = self.roster.candidates(f"step {self.step} of stage {self.stage}")
        if ShardWriter.is_committed(self.paths, self.stage, self.step, pipeline.PRODUCER):
            return self.skip(engines)
        policy_ref = wait_for_policy(self.sc, self.paths, self.spec.need,
                                     what=f"step {self.step} of stage {self.stage}",
                                     beat=lambda text: self.waiting(engines, text), taken_back=self.hooks.taken_back)
        self.tally.policy_ready()
        self.tally.policy_version = policy_ref[0] if policy_ref is not None else None
        hello = self.start_engines([e for e in engines if e not in self.roster.job.dead], policy_ref)
        q = self.queue
        q.items, carried = self.levers.carry_in(self.paths, self.stage, self.step, q.items)
        self.prepare_admission(hello)
        q.results.update(carried)
        self.resume_from_journal()
        self.close_if_due()   # a rerun whose journal already completes enough groups closes at once
        while not self.levers.over(q.items, q.results):
            self.dispatch(q.admit(self.tally.elapsed()))
            got = self.collect()
            self.requeue(self.roster.check())
            self.beat_if_moved()
            self.journal.maybe_write(q.results)
            if self.hooks.stop():
                self.journal.maybe_write(q.results, force=True)
                self.roster.drain()
                raise StopRequested(f"{self.hooks.stop()}: step {self.step} of stage {self.stage} stopped with "
                                    f"{len(q.results)} of {len(q.items)} trajectories in its journal")
            if not got:
                time.sleep(0.005)
        generation_s = self.tally.elapsed()
        self.heartbeat("committing", "commit", every_s=0.0)
        engine_stats, lost = self.roster.finish(self.step)
        self.requeue(lost)
        trajs = self.commit()
        return self.tally.summary(self.paths, trajs, generation_s, last_admit_s=q.last_admit_s(),
                                  admission=self.sc.admission, lost=[x.rank for x in self.roster.lost],
                                  engine_stats=engine_stats, weights_via=self.weights.via, levers=self.levers.metrics())

    def beat_if_moved(self) -> None:
        """The heartbeat while generating carries progress: written only when an engine moved since the last one
        (roster.py), so a rollout whose engines all stop goes stale and its launcher restarts it."""
        moved, q = self.roster.moved_at(), self.queue
        if moved > self.beat_moved and self.heartbeat(f"generating, {len(q.results)}/{len(q.items)} trajectories "
                                                      f"done; last progress {time.monotonic() - moved:.0f}s ago",
                                                      "generate"):
            self.beat_moved = moved

    def heartbeat(self, text: str, phase: str, every_s: float | None = None) -> bool:
        """The role's heartbeat file, with each engine's state (`run status`); whether it was written."""
        kw = {} if every_s is None else {"every_s": every_s}
        return self.hooks.heartbeat(f"step {self.step} of stage {self.stage}: {text}", phase,
                             engines=self.roster.views(), **kw)

    # ----------------------------------------------------------------------------------------------- start
    def waiting(self, engines: list[int], text: str) -> None:
        """While rank 0 waits for the step's policy: keep-alive to the engines, stuck loads judged, and say why."""
        if self.hooks.stop():
            self.roster.drain()
            raise StopRequested(f"{self.hooks.stop()} while step {self.step} of stage {self.stage} waited for its policy")
        self.requeue(self.roster.judge_loads())
        self.roster.keep_alive(engines)
        self.heartbeat(text, "wait_policy", every_s=self.sc.heartbeat_s)

    def skip(self, engines: list[int]) -> dict:
        log.info("step %d of stage %s already committed: nothing to do", self.step, self.stage)
        self.roster.broadcast(TAG_SKIP, None, engines)
        self.roster.drain()
        return {"step": self.step, "skipped": True}

    def start_engines(self, engines: list[int], policy_ref: tuple[int, str] | None) -> dict[int, dict]:
        """START every engine rank (roster.start); their HELLOs by rank. Those lost on the way are left out of the
        step: their keepers start them again and they join a later one."""
        start = {"policy_version": self.tally.policy_version, "policy_dir": policy_ref[1] if policy_ref else None,
                 "stage": self.stage, "step": self.step, "limits": list(self.spec.limits)}
        if policy_ref is not None and policy_ref[1] == MEMORY:
            start.update(self.weights.memory_session(engines, policy_ref[0]))
            self.tally.policy_version = start["policy_version"]
        hello, lost = self.roster.start(engines, start, lambda text: self.heartbeat(text, "start_engines"))
        self.tally.policy_version = self.weights.record(hello, self.tally.policy_version)
        self.requeue(lost)
        return hello

    def prepare_admission(self, hello: dict[int, dict]) -> None:
        """Admission over the engines that said hello, and the FIFO of the step's trajectories."""
        self.tally.engines = sorted(hello)
        self.queue.open(admission_for(self.sc, {e: hello[e]["capacity_tokens"] for e in sorted(hello)},
                                      self.spec.limits.max_response_length))

    def resume_from_journal(self) -> None:
        """The trajectories an earlier attempt of this step committed to its journal: kept, not run again."""
        q = self.queue
        if q.keep(self.journal.load()):
            log.info("step %d of stage %s: %d of %d trajectories kept from an interrupted attempt", self.step,
                     self.stage, len(q.results), len(q.items))
            if self.hooks.progress is not None:
                self.hooks.progress(list(q.results))
        self.tally.kept_from_journal = self.journal.loaded

    # ----------------------------------------------------------------------------------------------- the loop
    def dispatch(self, batch: dict[int, list[WorkItem]]) -> None:
        for e, work in batch.items():
            self.roster.send(e, TAG_WORK, work)

    def collect(self) -> bool:
        """Every message waiting now: results, reports, turn boundaries, deaths, late joiners. True if there was
        any."""
        comm, MPI = self.roster.comm, self.roster.MPI
        got = False
        st = MPI.Status()
        while comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=st):
            got = True
            src, tag = st.Get_source(), st.Get_tag()
            msg = comm.recv(source=src, tag=tag)
            if not self.roster.heard(src, moved=tag in (TAG_RESULT, TAG_TURN)):
                continue   # a rank declared lost that was only slow: its work already runs elsewhere
            if tag == TAG_RESULT:
                (self.on_paused if msg.paused else self.on_result)(msg)
            elif tag == TAG_KV:
                self.on_report(src, msg)
            elif tag == TAG_TURN:
                self.queue.turn(src, msg)
            elif tag == TAG_MOVED:
                self.levers.on_moved(tuple(msg["key"]))
            elif tag == TAG_DEAD:
                self.requeue([self.roster.lose(src, str(msg))])
            elif tag == TAG_HELLO:
                self.join(src, msg)
            elif tag == TAG_ACK:
                self.roster.on_ack(src, msg)
        return got

    def join(self, src: int, hello: dict) -> None:
        """A slow loader said HELLO: admission places work on it from now."""
        if not self.roster.on_hello(src, hello):
            return
        self.queue.admission.add_engine(src, hello["capacity_tokens"])
        self.tally.engines.append(src)
        self.weights.joined(src, hello)
        log.info("engine rank %d joined step %d of stage %s late, %.1fs into generation", src, self.step, self.stage,
                 self.tally.elapsed())

    def on_result(self, res: TrajectoryResult) -> None:
        """Score a finished trajectory, its booking freed (a duplicate or a stale step's result is ignored)."""
        q = self.queue
        if not q.is_open(res):
            return
        self.tally.infra_failures += res.output.infra_failures
        if q.rerun_for_infra(res, self.sc.infra_reruns):   # the sandbox lost a tool call: from its prompt again
            self.tally.infra_reruns += 1
            if self.levers.closing:   # the step is closed: carried, from its prompt
                self.levers.carry_queued(q.take_waiting())
            return
        q.release(res.key)
        t0 = time.perf_counter()
        q.results[res.key] = self.score(self.stage, self.step, q.by_key[res.key], res, q.queued_at[res.key])
        self.tally.reward_s += time.perf_counter() - t0
        if self.hooks.progress is not None:
            self.hooks.progress([res.key], sum(q.results[res.key].loss_mask))
        self.levers.on_finished(res.key)
        self.close_if_due()

    def on_paused(self, res: TrajectoryResult) -> None:
        """A paused trajectory with its state: the levers say requeue (migration: at the front) or carry (closing)."""
        if not self.queue.is_open(res):
            return
        item = self.queue.paused(res)
        if self.levers.paused(res.key, item) is Route.REQUEUE:
            self.queue.pending.appendleft(item)

    def on_report(self, src: int, report: dict) -> None:
        """An engine's report: its progress (the roster's), re-book its trajectories; maybe ask it to let one
        migrate."""
        q = self.queue
        self.roster.on_report(src, report)
        if self.roster.starting(src):
            return
        q.admission.observe(src, report.get("contexts", {}))
        key = self.levers.migration(src, report.get("movable", ()), q.admission, queue_empty=not q.pending)
        if key is not None:
            self.roster.send(src, TAG_MIGRATE, {"key": key})

    def close_if_due(self) -> None:
        """Partial rollouts: once the levers say so, close the step: PAUSE every engine, carry the queue."""
        q = self.queue
        if not self.levers.should_close(q.items, q.results):
            return
        self.levers.close(self.tally.elapsed())
        self.roster.broadcast(TAG_PAUSE, None, self.roster.ready())
        self.levers.carry_queued(q.take_waiting())
        log.info("step %d of stage %s closes (partial rollouts): %d of %d trajectories done", self.step, self.stage,
                 len(q.results), len(q.items))

    def requeue(self, lost: list[Lost]) -> None:
        """Engines the roster lost: their unfinished trajectories back to the front of the queue, from their last
        turn boundary where partial rollouts keep one (carried as they are once the step has closed)."""
        q = self.queue
        for x in lost:
            back, resumed = q.engine_lost(x.rank)
            self.tally.reruns += back
            self.tally.reruns_resumed += resumed
            record_event(self.paths, "engine_hung" if x.hung else "engine_lost", role="rollout", rank=x.rank,
                         stage=self.stage, step=self.step, requeued=back, requeued_resumed=resumed, reason=x.why,
                         starting=x.starting)
            log.error("engine rank %d lost (%s): %d unfinished trajectories re-queued (%d from a turn boundary or "
                      "pause)", x.rank, x.why, back, resumed)
        if lost and self.levers.closing:   # the step is closed: they are carried as they were
            self.levers.carry_queued(q.take_waiting())
        if lost and q.admission and not self.roster.live() and not self.levers.over(q.items, q.results):
            raise RuntimeError(f"all engine ranks died; {len(q.items) - len(q.results)} trajectories of step "
                               f"{self.step} unfinished, nothing written")

    # ----------------------------------------------------------------------------------------------- the end
    def commit(self) -> list[Trajectory]:
        """The step's trajectories, in item order, written as one committed shard set (with partial rollouts, its
        complete groups' only: the rest is carried, saved first)."""
        trajs, carry = self.levers.split(self.queue.items, self.queue.results)
        if carry is not None:   # saved before the commit: a kill between the two re-runs the step (carry.py)
            carry_mod.save(self.paths, self.stage, self.step, carry)
        with ShardWriter(self.paths, self.stage, self.step, pipeline.PRODUCER) as w:
            w.write(trajs)
        self.journal.clear()
        return trajs
