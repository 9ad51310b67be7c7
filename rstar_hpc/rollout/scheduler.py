"""Rank 0 of a rollout step: admit each trajectory to an engine rank, collect results, commit, publish metrics.

    rstar-hpc rollout --config tiny-cpu --engines 2 --step 0       # or one srun task per rank under Slurm

`StepScheduler.run` reads top-down as the step's stages:

    start_engines    wait for the policy the step needs (pipeline.policy_need), name it, the stage, step, limits
                     and sampling in START; each engine rank acks at once, loads it if new, says HELLO with its KV
    admit            FIFO: the shared admission (admission.py: `kv_aware` or `static`) places the head of the queue
                     on an engine rank, which keeps it for all its turns; nothing jumps the queue
    dispatch         send each engine rank its admitted work (never a blocking send)
    collect          results (release the booking, score off the generation path), heartbeats (KV booking from
                     the live trajectories' context lengths), turn boundaries, deaths; every `journal_every_s` the
                     new results go to a journal part, so a restart runs only the unfinished trajectories
    keep_alive       heartbeat the engines; an engine rank silent for `engine_timeout_s` is dropped
    finish_engines   DONE; each engine rank answers with its figures
    commit           all trajectories, in item order, in ONE committed shard set (producer "rollout"), then the
                     journal parts go: readers see a step whole or not at all
    publish_metrics  the step's summary, appended to metrics/rollout.jsonl and returned

State: everything rank 0 keeps for a step is declared, typed, in `StepScheduler.__init__`; the long-tail levers
(levers.py) keep their own and return decisions (migrate this key, requeue or carry this paused trajectory, close
the step, the trained/carried split), which the scheduler applies (its sends, queue and admission bookings).
docs/architecture.md draws the loop as a state diagram.

Tool calls are not dispatched here: each engine rank runs its trajectories as agent-loop coroutines (agent.py)
that call the sandbox service themselves, so a trajectory waiting for its tool never holds up generation.

Engine death (it reports its engine dead, its keeper reports its process dead: links.py, or it is silent for
`engine_timeout_s`): it is dropped until it joins again, its unfinished trajectories go back to the front of the
queue, from their last turn boundary (partial rollouts: TURN deltas) or pause, else from the start; a late result
or delta of one re-run is ignored (they carry their step and key, and only the key's engine is heard). Rank 0 heartbeats too and sends ABORT when it fails; an engine rank that hears nothing
from it for `engine_timeout_s` leaves. The messages are mpi.py's; the engine ranks' side is engine_rank.py.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque

from rstar_hpc import pipeline
from rstar_hpc.config.rollout import SchedulerConfig
from rstar_hpc.exchange.events import record_event
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.schema import Trajectory
from rstar_hpc.exchange.writer import ShardWriter
from rstar_hpc.rollout import carry as carry_mod
from rstar_hpc.rollout.admission import Admission, make_admission
from rstar_hpc.rollout.journal import Journal
from rstar_hpc.rollout.levers import Levers, Route
from rstar_hpc.rollout.agent import AgentResult
from rstar_hpc.rollout.messages import TrajectoryResult, TurnDelta
from rstar_hpc.rollout.mpi import (TAG_ACK, TAG_ALIVE, TAG_DEAD, TAG_DONE, TAG_HELLO, TAG_KV, TAG_MIGRATE, TAG_MOVED,
                                   TAG_PAUSE, TAG_RESULT, TAG_SKIP, TAG_START, TAG_STATS, TAG_TURN, TAG_WORK,
                                   wait_sent)
from rstar_hpc.rollout.policy_source import MEMORY, StepWeights, wait_for_policy
from rstar_hpc.rollout.step import Scorer, StepHooks, StepSpec, WorkItem, publish_summary

FILE_BEAT_S = 10.0   # the role's heartbeat file during a phase: often enough for `run status`, cheap on Lustre
log = logging.getLogger("rstar_hpc.rollout")


class StopRequested(Exception):
    """Slurm's pre-timeout USR2 or a TERM reached rank 0: the step's finished trajectories are in its journal."""


class StepScheduler:
    """Rank 0's side of one step. `dead_ranks` carries the engine ranks lost in earlier steps of the job and
    `engine_versions` the policy each engine runs (both the job's, updated in place); `engine_workers`: the vLLM
    workers of an engine (its tensor-parallel size)."""

    def __init__(self, comm, MPI, sc: SchedulerConfig, paths: RunPaths, spec: StepSpec, *, score: Scorer,
                 hooks: StepHooks | None = None, dead_ranks: set[int] | None = None, engine_workers: int = 1,
                 engine_versions: dict[int, int | None] | None = None):
        # what the step is, and who it reports to
        self.comm, self.MPI, self.sc, self.paths, self.score = comm, MPI, sc, paths, score
        self.stage, self.step, self.limits, self.need = spec.stage, spec.step, spec.limits, spec.need
        self.items: list[WorkItem] = list(spec.items)   # in item order; the carry goes first (Levers.carry_in)
        self.dropped = list(spec.dropped)
        hooks = hooks or StepHooks()
        self.progress, self.beat_file, self.stop, self.taken_back = hooks.progress, hooks.beat, hooks.stop, \
            hooks.taken_back
        self.dead_ranks: set[int] = set() if dead_ranks is None else dead_ranks   # the job's, updated in place
        # how the engines get the step's weights (files or an in-memory session) and how they got them
        self.weights = StepWeights(paths, spec.stage, spec.step, spec.need, engine_workers, engine_versions)
        # the engines
        self.engines: list[int] = []              # those that said HELLO
        self.alive: dict[int, float] = {}         # engine rank -> when it was last heard from
        self.dead: list[int] = []                 # engine ranks lost in this step
        self.admission: Admission | None = None   # made from the HELLOs' KV capacities (prepare_admission)
        self.policy_version: int | None = None    # the model policy the step generates with (None: the base model)
        # the queue and the results
        self.by_key: dict[tuple, WorkItem] = {}   # every item by key, with its latest resume state
        self.pending: deque[WorkItem] = deque()   # FIFO, not admitted yet
        self.queued_at: dict[tuple, float] = {}   # seconds into generation each item was last admitted
        self.results: dict[tuple, Trajectory] = {}
        # MPI and time
        self.sends: list = []                     # non-blocking sends in flight
        self.last_beat = 0.0
        self.last_file_beat, self.last_phase = 0.0, ""
        self.t_start = time.monotonic()           # generation's start (run resets it once the policy is there)
        # counters of the step's summary
        self.reward_s = 0.0
        self.policy_wait_s = 0.0
        self.reruns = 0
        self.requeued_resumed = 0                 # of the reruns, those resumed from a boundary, not the start
        self.infra_failures = 0
        self.journal = Journal(paths, spec.stage, spec.step, sc.journal_every_s)
        self.levers = Levers(sc)

    def run(self) -> dict:
        """The step, stage by stage; returns its summary (also appended to metrics/rollout.jsonl)."""
        engines = self.live_engines()
        if ShardWriter.is_committed(self.paths, self.stage, self.step, pipeline.PRODUCER):
            return self.skip(engines)
        policy_ref = wait_for_policy(self.sc, self.paths, self.need, what=f"step {self.step} of stage {self.stage}",
                                     beat=lambda text: self.waiting(engines, text), taken_back=self.taken_back)
        self.policy_wait_s = time.monotonic() - self.t_start   # the rollout idle, waiting on the trainer
        self.t_start = time.monotonic()
        self.policy_version = policy_ref[0] if policy_ref is not None else None
        hello = self.start_engines(engines, policy_ref)
        self.items, carried = self.levers.carry_in(self.paths, self.stage, self.step, self.items)
        self.prepare_admission(hello)
        self.results.update(carried)
        self.resume_from_journal()
        self.close_if_due()   # a rerun whose journal already completes enough groups closes at once
        while not self.levers.over(self.items, self.results):
            self.dispatch(self.admit())
            got = self.collect()
            self.keep_alive()
            self.journal.maybe_write(self.results)
            if self.stop():
                self.journal.maybe_write(self.results, force=True)
                self.drain_sends()
                raise StopRequested(f"{self.stop()}: step {self.step} of stage {self.stage} stopped with "
                                    f"{len(self.results)} of {len(self.items)} trajectories in its journal")
            if not got:
                time.sleep(0.005)
        generation_s = time.monotonic() - self.t_start
        self.beat("committing", "commit", every_s=0.0)
        engine_stats = self.finish_engines()
        trajs = self.commit()
        return self.publish_metrics(trajs, generation_s, engine_stats)

    # ----------------------------------------------------------------------------------------------- start
    def live_engines(self) -> list[int]:
        engines = [e for e in range(1, self.comm.Get_size()) if e not in self.dead_ranks]
        if not engines:
            raise RuntimeError(f"no engine rank can run step {self.step}: of {self.comm.Get_size() - 1}, these died "
                               f"or never joined: {sorted(self.dead_ranks)}")
        return engines

    def drain_sends(self) -> None:
        """Before rank 0 leaves: let the engines take what was sent. A message past Open MPI's eager limit (a WORK
        batch of two long prompts) is read from the sender's memory; if rank 0 has exited by then the engine rank's
        read fails and it hangs, and so does the job (seen: Ctrl-C right after a WORK send)."""
        if not wait_sent(self.sends, min(self.sc.engine_timeout_s, 10.0)):
            log.warning("engine ranks did not take %d messages before rank 0 stopped", len(self.sends))

    def waiting(self, engines: list[int], text: str) -> None:
        """While rank 0 waits for the step's policy: keep the engines waiting too (heartbeats), and say why."""
        if self.stop():
            self.drain_sends()
            raise StopRequested(f"{self.stop()} while step {self.step} of stage {self.stage} waited for its policy")
        now = time.monotonic()
        if now - self.last_beat > self.sc.heartbeat_s:
            self.sends += [self.comm.isend(None, dest=e, tag=TAG_ALIVE) for e in engines]
            self.sends[:] = [r for r in self.sends if not r.Test()]
            self.last_beat = now
            self.beat(text, "wait_policy", every_s=0.0)

    def beat(self, text: str, phase: str, every_s: float = FILE_BEAT_S) -> None:
        """The role's heartbeat file (RUN/heartbeat/rollout.json), at most every `every_s`: `run status` shows it,
        and a launcher restarts the rollout when it goes stale (launch.hang_timeout_s), so every phase of a step
        beats, generation and engine start included."""
        now = time.monotonic()
        if self.beat_file is not None and (now - self.last_file_beat >= every_s or phase != self.last_phase):
            self.last_file_beat, self.last_phase = now, phase   # a new phase shows at once
            self.beat_file(f"step {self.step} of stage {self.stage}: {text}", phase=phase)

    def resume_from_journal(self) -> None:
        """The trajectories an earlier attempt of this step committed to its journal: kept, not run again."""
        for key, traj in self.journal.load().items():
            if key in self.by_key and key not in self.results:
                self.results[key] = traj
        if self.results:
            log.info("step %d of stage %s: %d of %d trajectories kept from an interrupted attempt", self.step,
                     self.stage, len(self.results), len(self.items))
            if self.progress is not None:
                self.progress(list(self.results))

    def skip(self, engines: list[int]) -> dict:
        log.info("step %d of stage %s already committed: nothing to do", self.step, self.stage)
        for e in engines:
            self.comm.send(None, dest=e, tag=TAG_SKIP)
        return {"step": self.step, "skipped": True}

    def start_engines(self, engines: list[int], policy_ref: tuple[int, str] | None) -> dict[int, dict]:
        """START every engine rank; their HELLOs by rank. An engine acks the start at once, then loads the step's
        policy, then says hello: one that does not ack is dead after engine_timeout_s, one that loads gets
        policy_load_timeout_s more."""
        comm, MPI, sc = self.comm, self.MPI, self.sc
        start = {"policy_version": self.policy_version, "policy_dir": policy_ref[1] if policy_ref else None,
                 "stage": self.stage, "step": self.step, "limits": list(self.limits)}
        if policy_ref is not None and policy_ref[1] == MEMORY:
            start.update(self.weights.memory_session(engines, policy_ref[0]))
            self.policy_version = start["policy_version"]
        self.sends += [comm.isend(start, dest=e, tag=TAG_START) for e in engines]
        hello: dict[int, dict] = {}
        acked: set[int] = set()
        t0 = time.monotonic()
        while len(hello) < len(engines):
            now = time.monotonic()
            if all(now - t0 > sc.engine_timeout_s + (sc.policy_load_timeout_s if e in acked else 0)
                   for e in engines if e not in hello):
                break
            st = MPI.Status()
            if comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=st):
                src, tag = st.Get_source(), st.Get_tag()
                msg = comm.recv(source=src, tag=tag)
                if tag == TAG_HELLO:
                    hello[src] = msg
                elif tag == TAG_ACK:
                    acked.add(src)
                # anything else is a leftover of the previous step (a late result or KV beat): dropped
            else:
                time.sleep(0.005)
            self.beat(f"starting {len(engines)} engine(s), {len(hello)} ready", "start_engines")
            if now - self.last_beat > sc.heartbeat_s:   # engines that are ready wait for the slow loaders
                self.sends += [comm.isend(None, dest=e, tag=TAG_ALIVE) for e in hello]
                self.last_beat = now
        if not hello:
            raise RuntimeError(f"no engine rank started step {self.step} (waited {time.monotonic() - t0:.0f}s)")
        self.policy_version = self.weights.record(hello, self.policy_version)
        missing = [e for e in engines if e not in hello]
        if missing:
            log.error("engine ranks %s did not start step %d; running without them", missing, self.step)
        self.dead += missing
        return hello

    def prepare_admission(self, hello: dict[int, dict]) -> None:
        """Admission over the engines that said hello, and the FIFO of the step's trajectories."""
        sc = self.sc
        engines = sorted(hello)
        self.engines = engines
        self.admission = make_admission(sc.admission, {e: hello[e]["capacity_tokens"] for e in engines},
                                        max_response=self.limits.max_response_length,
                                        growth_reserve=sc.growth_reserve, budget_coef=sc.budget_coef,
                                        max_per_engine=sc.max_trajectories_per_engine, share_prefix=sc.sibling_aware)
        self.by_key = {it.key: it for it in self.items}
        if len(self.by_key) != len(self.items):
            raise ValueError("duplicate (prompt_uid, sample_index) in the step's prompts; uids must be unique")
        for it in self.items:
            self.admission.check_fits_somewhere(len(it.prompt_ids))
        self.pending = deque(it for it in self.items if it.key not in self.results)
        self.queued_at = {it.key: 0.0 for it in self.items}
        self.alive = {e: time.monotonic() for e in engines}

    # ----------------------------------------------------------------------------------------------- the loop
    def admit(self) -> dict[int, list[WorkItem]]:
        """FIFO, the head waits for room (rStar2: nothing jumps the queue); the admitted work by engine rank."""
        assert self.admission is not None, "prepare_admission first"
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
            self.queued_at[it.key] = time.monotonic() - self.t_start
            batch.setdefault(e, []).append(it)
        return batch

    def dispatch(self, batch: dict[int, list[WorkItem]]) -> None:
        # never a blocking send: a large message to a rank that just died would wait forever (rendezvous)
        for e, work in batch.items():
            self.sends.append(self.comm.isend(work, dest=e, tag=TAG_WORK))
        self.sends[:] = [r for r in self.sends if not r.Test()]

    def collect(self) -> bool:
        """Every message waiting now: results, heartbeats, deaths. True if there was any."""
        comm, MPI = self.comm, self.MPI
        got = False
        st = MPI.Status()
        while comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=st):
            got = True
            src, tag = st.Get_source(), st.Get_tag()
            msg = comm.recv(source=src, tag=tag)
            if src not in self.alive:
                continue   # a rank declared dead that was only slow: its work already runs elsewhere
            self.alive[src] = time.monotonic()
            if tag == TAG_RESULT:
                if msg.paused:
                    self.on_paused(msg)
                else:
                    self.on_result(msg)
                    self.levers.on_finished(msg.key)
                    self.close_if_due()
            elif tag == TAG_KV:
                self.on_kv(src, msg)
            elif tag == TAG_TURN:
                self.on_turn(src, msg)
            elif tag == TAG_MOVED:
                self.levers.on_moved(tuple(msg["key"]))
            elif tag == TAG_DEAD:
                self.lose(src, msg)
        return got

    def on_result(self, res: TrajectoryResult) -> None:
        """Release the trajectory's booking and score it (a duplicate or a stale step's result is ignored)."""
        key = res.key
        if res.step != self.step or key in self.results or key not in self.by_key:
            return
        self.release(key)
        t0 = time.perf_counter()
        self.infra_failures += res.output.infra_failures
        self.results[key] = self.score(self.stage, self.step, self.by_key[key], res, self.queued_at[key])
        self.reward_s += time.perf_counter() - t0
        if self.progress is not None:
            self.progress([key], sum(self.results[key].loss_mask))

    def on_paused(self, res: TrajectoryResult) -> None:
        """A paused trajectory with its state: the levers say requeue (migration: at the front) or carry (closing)."""
        key = res.key
        if res.step != self.step or key in self.results or key not in self.by_key:
            return
        item = dataclasses.replace(self.by_key[key], resume=res.output)
        self.by_key[key] = item   # a requeue after an engine death resumes from here too
        self.release(key)
        if self.levers.paused(key, item) is Route.REQUEUE:
            self.pending.appendleft(item)

    def on_turn(self, src: int, delta: TurnDelta) -> None:
        """A trajectory of engine `src` passed a turn boundary: a requeue after that engine's death resumes there."""
        key, item = delta.key, self.by_key.get(delta.key)
        if item is None or delta.step != self.step or key in self.results or \
                self.admission.placed.get(key, [None])[0] != src:
            return   # a stale attempt's (the key re-runs elsewhere)
        state = delta.onto(item.resume or AgentResult(prompt_ids=list(item.prompt_ids), prompt_text=item.prompt_text))
        if state is not None:
            self.by_key[key] = dataclasses.replace(item, resume=state)

    def on_kv(self, src: int, beat: dict) -> None:
        """An engine's KV heartbeat: re-book its trajectories; maybe ask it to let one migrate."""
        self.admission.observe(src, beat.get("contexts", {}))
        key = self.levers.migration(src, beat.get("movable", ()), self.admission, queue_empty=not self.pending)
        if key is not None:
            self.sends.append(self.comm.isend({"key": key}, dest=src, tag=TAG_MIGRATE))

    def release(self, key: tuple) -> None:
        if self.admission.placed.get(key) is not None:
            self.admission.release(key)

    def close_if_due(self) -> None:
        """Partial rollouts: once the levers say so, close the step: PAUSE every engine, carry the queue."""
        if not self.levers.should_close(self.items, self.results):
            return
        self.levers.close(self.elapsed())
        self.sends += [self.comm.isend(None, dest=e, tag=TAG_PAUSE) for e in self.alive]
        self.carry_queue()
        log.info("step %d of stage %s closes (partial rollouts): %d of %d trajectories done", self.step, self.stage,
                 len(self.results), len(self.items))

    def carry_queue(self) -> None:
        """The step closed: what was never admitted (or was re-queued) is carried as it is."""
        left = [self.by_key[it.key] for it in self.pending if it.key not in self.results]
        self.pending.clear()
        self.levers.carry_queued(left)

    def keep_alive(self) -> None:
        """Heartbeat the engines (they leave when rank 0 goes silent), and drop the ones gone silent."""
        now = time.monotonic()
        if now - self.last_beat > self.sc.heartbeat_s:
            self.sends += [self.comm.isend(None, dest=e, tag=TAG_ALIVE) for e in self.alive]
            self.last_beat = now
        for e, seen in list(self.alive.items()):
            if now - seen > self.sc.engine_timeout_s:
                self.lose(e, f"silent for {now - seen:.0f}s")
        self.beat(f"generating, {len(self.results)}/{len(self.items)} trajectories done", "generate")

    def lose(self, e: int, why: str) -> None:
        log.error("engine rank %d lost (%s); re-queueing its unfinished trajectories (from their last turn boundary "
                  "where partial rollouts keep one)", e, why)
        self.alive.pop(e, None)
        self.dead.append(e)
        back = [k for k in self.admission.engine_lost(e) if k not in self.results]
        self.reruns += len(back)
        for k in reversed(back):
            self.pending.appendleft(self.by_key[k])
        resumed = sum(self.by_key[k].resume is not None for k in back)   # from a turn boundary or a pause
        self.requeued_resumed += resumed
        record_event(self.paths, "engine_lost", role="rollout", rank=e, stage=self.stage, step=self.step,
                     requeued=len(back), requeued_resumed=resumed, reason=why)
        if self.levers.closing:   # the step is closed: they are carried as they were
            self.carry_queue()
        if not self.alive:
            raise RuntimeError(f"all engine ranks died; {len(self.items) - len(self.results)} trajectories of step "
                               f"{self.step} unfinished, nothing written")

    # ----------------------------------------------------------------------------------------------- the end
    def finish_engines(self) -> dict[int, dict]:
        """DONE to every live engine; their figures of the step by rank. One that does not answer is presumed
        dead: its results are all in, the next step goes on without it."""
        comm, MPI = self.comm, self.MPI
        for e in self.alive:
            self.sends.append(comm.isend(None, dest=e, tag=TAG_DONE))
        engine_stats: dict[int, dict] = {}
        deadline = time.monotonic() + self.sc.engine_timeout_s
        while len(engine_stats) < len(self.alive) and time.monotonic() < deadline:
            st = MPI.Status()
            if comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_STATS, status=st):
                engine_stats[st.Get_source()] = comm.recv(source=st.Get_source(), tag=TAG_STATS)
            else:
                time.sleep(0.005)
        for e in self.alive:
            if e not in engine_stats:
                log.error("engine rank %d did not report at the end of step %d; presumed dead", e, self.step)
                self.dead.append(e)
        self.dead_ranks.update(self.dead)
        return engine_stats

    def elapsed(self) -> float:
        return time.monotonic() - self.t_start

    def commit(self) -> list[Trajectory]:
        """The step's trajectories, in item order, written as one committed shard set (with partial rollouts, its
        complete groups' only: the rest is carried, saved first)."""
        trajs, carry = self.levers.split(self.items, self.results)
        if carry is not None:   # saved before the commit: a kill between the two re-runs the step (carry.py)
            carry_mod.save(self.paths, self.stage, self.step, carry)
        with ShardWriter(self.paths, self.stage, self.step, pipeline.PRODUCER) as w:
            w.write(trajs)
        self.journal.clear()
        return trajs

    def publish_metrics(self, trajs: list[Trajectory], generation_s: float, engine_stats: dict[int, dict]) -> dict:
        return publish_summary(self, trajs, generation_s, engine_stats)
