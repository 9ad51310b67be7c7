"""rollout/roster.py: rank 0 judges each engine by progress, not presence, and loses nothing while engines start.

A scripted communicator and a fake clock (no MPI, no engine): the judgment itself. The real engines' side (their
token counter, a SIGSTOPped engine core found and restarted) is tests/integration/test_engine_isolation.py's.
"""
from __future__ import annotations

import time

import pytest

from rstar_hpc.config.rollout import SchedulerConfig
from rstar_hpc.rollout.mpi import TAG_ABORT, TAG_ACK, TAG_DEAD, TAG_HELLO, TAG_KV, TAG_START, TAG_STATS
from rstar_hpc.rollout.engines import Engine
from rstar_hpc.rollout.roster import EngineRoster


class _Clock:
    def __init__(self, monkeypatch):
        self.now = 1000.0
        monkeypatch.setattr(time, "monotonic", lambda: self.now)
        monkeypatch.setattr(time, "sleep", self.sleep)

    def sleep(self, s: float) -> None:
        self.now += max(s, 0.5)   # a coarse tick: the scripted messages arrive at their times


class _Status:
    def __init__(self):
        self.src = self.tag = None

    def Get_source(self):
        return self.src

    def Get_tag(self):
        return self.tag


class _MPI:
    ANY_SOURCE, ANY_TAG, Status = -1, -1, _Status


class _Sent:
    def Test(self):
        return True


class _Comm:
    """Engine ranks 1..size-1; `script` holds (time, source, tag, message) arriving at rank 0."""

    def __init__(self, clock: _Clock, size: int, script: list[tuple]):
        self.clock, self.size, self.script, self.sent, self.restarts = clock, size, sorted(script), [], []

    def Get_size(self):
        return self.size

    def isend(self, msg, dest, tag):
        self.sent.append((dest, tag, msg))
        return _Sent()

    def Iprobe(self, source, tag, status):
        for at, src, t, _ in self.script:
            if at <= self.clock.now and (tag == -1 or t == tag) and source in (-1, src):
                status.src, status.tag = src, t
                return True
        return False

    def recv(self, source, tag):
        for i, (at, src, t, msg) in enumerate(self.script):
            if at <= self.clock.now and src == source and t == tag:
                del self.script[i]
                return msg
        raise AssertionError("nothing to receive")

    def request_restart(self, rank, why):
        self.restarts.append((rank, why))


def _sc(**kw):
    return SchedulerConfig(**{"heartbeat_s": 1.0, "engine_timeout_s": 30.0, "policy_load_timeout_s": 600.0,
                              "engine_stall_s": 20.0, **kw})


def test_start_drops_a_dead_or_silent_engine_at_once_and_waits_for_a_reporting_loader(monkeypatch):
    clock = _Clock(monkeypatch)
    t = clock.now
    script = [(t + 1, 1, TAG_ACK, {"loading": True}), (t + 1, 2, TAG_ACK, {"loading": True}),
              (t + 1, 3, TAG_ACK, {"loading": True}),
              (t + 3, 2, TAG_DEAD, "its process 42 ended (signal SIGKILL)"),   # died while loading
              *[(t + 1 + k * 10, 1, TAG_KV, {"starting": "loading the policy"}) for k in range(1, 10)],
              (t + 100, 1, TAG_HELLO, {"capacity_tokens": 1000})]               # a 100 s load that reports
    comm = _Comm(clock, 5, script)                                              # 4 acks nothing at all
    roster = EngineRoster(comm, _MPI, _sc())
    beats = []
    hello, lost = roster.start([1, 2, 3, 4], {"step": 0}, beats.append)
    assert sorted(hello) == [1] and [d for d, tag, _ in comm.sent if tag == TAG_START] == [1, 2, 3, 4]
    why = {x.rank: x.why for x in lost}
    assert "SIGKILL" in why[2] and "no answer to START" in why[4]
    assert "silent for" in why[3] and "(loading the policy)" in why[3]         # acked, then nothing: not 630 s
    assert clock.now - t < 105                                                  # nobody waited out the load bound
    assert roster.live() == [1] and roster.engines[2].state == "dead" and beats[-1].endswith("1 ready")


def test_an_engine_ready_early_is_still_alive_after_a_long_start_of_another(monkeypatch):
    """Engine 1 says HELLO at once and reports while engine 2 loads for 100 s: after the start, 1 is not silent."""
    clock = _Clock(monkeypatch)
    t = clock.now
    script = [(t + 1, 1, TAG_ACK, {"loading": False}), (t + 1, 1, TAG_HELLO, {"capacity_tokens": 1000}),
              *[(t + 1 + k, 1, TAG_KV, {"tokens": 0, "generating": 0}) for k in range(1, 110)],
              (t + 1, 2, TAG_ACK, {"loading": True}),
              *[(t + 1 + k * 10, 2, TAG_KV, {"starting": "loading the policy"}) for k in range(1, 10)],
              (t + 100, 2, TAG_HELLO, {"capacity_tokens": 1000})]
    roster = EngineRoster(_Comm(clock, 3, script), _MPI, _sc(late_join_after_s=200.0))
    hello, lost = roster.start([1, 2], {"step": 0}, lambda text: None)
    assert sorted(hello) == [1, 2] and not lost
    assert roster.check() == [] and roster.live() == [1, 2]


def test_a_step_begins_without_a_slow_loader_which_joins_it_when_ready(monkeypatch):
    """late_join_after_s after the first HELLO the step begins; the loader stays in it, starting, judged by its load
    (reports, the load bound), gets no keep-alive it cannot read, and joins with its HELLO of this step only."""
    clock = _Clock(monkeypatch)
    t = clock.now
    step = {"stage": "rl", "step": 3}
    script = [(t + 1, 1, TAG_ACK, {"loading": True, **step}), (t + 2, 1, TAG_HELLO, {"capacity_tokens": 1000, **step}),
              *[(t + 1 + k, 1, TAG_KV, {"tokens": 0, "generating": 0}) for k in range(1, 60)],
              (t + 1, 2, TAG_ACK, {"loading": True, **step}),
              *[(t + 1 + k * 5, 2, TAG_KV, {"starting": "loading the policy"}) for k in range(1, 40)]]
    comm = _Comm(clock, 3, script)
    roster = EngineRoster(comm, _MPI, _sc(late_join_after_s=10.0))
    hello, lost = roster.start([1, 2], step, lambda text: None)
    assert sorted(hello) == [1] and not lost and t + 12 <= clock.now < t + 15   # not the load's 600 s
    assert roster.live() == [1, 2] and roster.ready() == [1] and roster.starting(2)
    comm.sent.clear()
    clock.now += 5.0
    roster.heard(2)
    roster.on_report(2, {"starting": "warming up"})
    assert roster.check() == [] and roster.views()["2"]["doing"] == "warming up"
    assert {d for d, tag, _ in comm.sent} == {1}                                # ALIVE to the ready one only
    assert not roster.on_hello(2, {"capacity_tokens": 1000, "stage": "rl", "step": 2})   # an earlier step's
    assert roster.on_hello(2, {"capacity_tokens": 1000, **step}) and roster.ready() == [1, 2]


def test_a_load_still_running_at_the_steps_end_keeps_its_clock_into_the_next_step(monkeypatch):
    """finish() does not wait for a loader, nor count it lost; the next step's start bounds its load from its first
    ack: a load stuck across steps is found hung at policy_load_timeout_s, not never."""
    from rstar_hpc.rollout.engines import JobEngines

    clock = _Clock(monkeypatch)
    t = clock.now
    job = JobEngines()
    script = [(t + 1, 1, TAG_ACK, {"loading": True}), (t + 2, 1, TAG_HELLO, {"capacity_tokens": 1000}),
              (t + 1, 2, TAG_ACK, {"loading": True}),
              *[(t + 1 + k, 2, TAG_KV, {"starting": "loading the policy"}) for k in range(1, 400)],
              *[(t + 1 + k, 1, TAG_KV, {"tokens": 0, "generating": 0}) for k in range(1, 400)],
              (t + 50, 1, TAG_STATS, {"step": 0, "done": 4}), (t + 130, 1, TAG_HELLO, {"capacity_tokens": 1000})]
    comm = _Comm(clock, 3, script)
    roster = EngineRoster(comm, _MPI, _sc(late_join_after_s=5.0, policy_load_timeout_s=120.0), job=job)
    roster.start([1, 2], {"step": 0}, lambda text: None)
    clock.now = t + 50
    stats, lost = roster.finish(0)
    assert list(stats) == [1] and not lost and job.dead == set() and job.loading == {2: t + 1}
    nxt = EngineRoster(comm, _MPI, _sc(late_join_after_s=5.0, policy_load_timeout_s=120.0), job=job)
    hello, lost = nxt.start([1, 2], {"step": 1}, lambda text: None)
    # engine 2 still loading step 0's policy: lost 120 s after its first ack, though it reports
    assert list(hello) == [1] and [(x.rank, x.hung, x.starting) for x in lost] == [(2, True, True)], lost
    assert "120s after START" in lost[0].why and comm.restarts == [(2, lost[0].why)]


def test_a_loader_past_the_load_bound_is_lost_though_it_reports(monkeypatch):
    clock = _Clock(monkeypatch)
    t = clock.now
    script = [(t + 1, 1, TAG_ACK, {"loading": True}),
              *[(t + 1 + k * 5, 1, TAG_KV, {"starting": "loading the policy"}) for k in range(1, 200)]]
    roster = EngineRoster(_Comm(clock, 2, script), _MPI, _sc(policy_load_timeout_s=120.0))
    with pytest.raises(RuntimeError, match="no engine rank started: 1: hung: still loading the policy 12[0-9]s"):
        roster.start([1], {"step": 0}, lambda text: None)


def test_an_engine_holding_requests_that_make_no_token_is_hung_and_restarted(monkeypatch):
    clock = _Clock(monkeypatch)
    comm = _Comm(clock, 4, [])
    roster = EngineRoster(comm, _MPI, _sc())
    roster.engines = {e: Engine(e, state="ready") for e in (1, 2, 3)}
    for second in range(40):
        clock.now += 1.0
        # 1 makes tokens; 2 holds requests and its counter stands still (its engine core stopped); 3's trajectories
        # all wait for their tools (nothing inside its engine): idle, not hung
        roster.heard(1), roster.on_report(1, {"tokens": 10 * second, "generating": 3})
        roster.heard(2), roster.on_report(2, {"tokens": 77, "generating": 2})
        roster.heard(3), roster.on_report(3, {"tokens": 5, "generating": 0})
        lost = roster.check()
        if lost:
            break
    [x] = lost
    assert x.rank == 2 and x.hung and "made no token for 2" in x.why and "engine_stall_s=20" in x.why
    assert 20 <= second <= 22                                           # found within engine_stall_s
    assert (2, TAG_ABORT) in [(d, tag) for d, tag, _ in comm.sent] and [r for r, _ in comm.restarts] == [2]
    assert roster.live() == [1, 3] and roster.engines[1].state == "generating" and roster.engines[3].state == "ready"
    assert not roster.heard(2)                                          # its late messages are not heard
    assert roster.views()["2"]["state"] == "hung"


def test_an_engine_that_stops_reporting_mid_generation_is_silent_not_hung(monkeypatch):
    """Its task lost whole: its last report held requests, then nothing. The silence rule takes it, not the stall
    rule (which would say its rank still reports)."""
    clock = _Clock(monkeypatch)
    roster = EngineRoster(_Comm(clock, 2, []), _MPI, _sc(engine_timeout_s=30.0, engine_stall_s=20.0))
    roster.engines = {1: Engine(1, state="ready")}
    roster.heard(1), roster.on_report(1, {"tokens": 5, "generating": 4})
    lost = []
    for _ in range(40):
        clock.now += 1.0
        lost += roster.check()
    [x] = lost
    assert not x.hung and "silent for 3" in x.why


def test_a_silent_engine_is_dead_and_its_process_restarted_a_reported_death_left_to_its_keeper(monkeypatch):
    clock = _Clock(monkeypatch)
    comm = _Comm(clock, 3, [])
    roster = EngineRoster(comm, _MPI, _sc())
    roster.engines = {e: Engine(e, state="ready") for e in (1, 2)}
    clock.now += 25
    roster.heard(1)
    clock.now += 10
    [x] = roster.check()
    assert x.rank == 2 and not x.hung and "silent for 35s" in x.why and [r for r, _ in comm.restarts] == [2]
    assert (2, TAG_ABORT) not in [(d, tag) for d, tag, _ in comm.sent]   # it hears nothing: its keeper kills it
    roster.lose(1, "its process 42 ended (signal SIGKILL)")             # a DEAD report: its keeper knows
    assert [r for r, _ in comm.restarts] == [2]


def test_stall_is_validated_against_the_report_interval():
    with pytest.raises(ValueError, match="engine_stall_s=4 .* at least 5 of them"):
        SchedulerConfig(heartbeat_s=1.0, engine_stall_s=4)


def test_run_status_shows_each_engines_state_and_the_hang(tmp_path, monkeypatch):
    """The step's heartbeat carries the roster's view; `run status` shows it per engine, and the hang in words."""
    from rstar_hpc.config import load_config
    from rstar_hpc.exchange.events import record_event
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.exchange.state import write_heartbeat
    from rstar_hpc.launch.status import run_status
    from rstar_hpc.rollout.step import StepHooks

    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}", "run.name=r"])
    paths = RunPaths(cfg.run.dir)
    clock = _Clock(monkeypatch)
    roster = EngineRoster(_Comm(clock, 3, []), _MPI, _sc())
    roster.engines = {1: Engine(1, state="generating"), 2: Engine(2, doing="loading the policy")}
    clock.now += 7
    hooks = StepHooks(beat=lambda text, **kw: write_heartbeat(paths, "rollout", text, **kw))
    hooks.heartbeat("step 3 of stage rl: generating", "generate", engines=roster.views())
    hooks.heartbeat("step 3 of stage rl: generating", "generate", engines={})   # within HEARTBEAT_S: not written
    record_event(paths, "engine_hung", role="rollout", rank=1, stage="rl", step=3, requeued=4, reason="hung: x")
    st = run_status(cfg, paths, with_slurm=False)
    assert st["roles"]["rollout"]["engines"] == {
        "1": {"state": "generating", "moved_s_ago": 7.0},
        "2": {"state": "starting", "moved_s_ago": 7.0, "doing": "loading the policy"}}
    assert "rollout engine rank 1 hung in step 3 of stage rl (hung: x): 4 trajectories requeued, its keeper " \
           "restarts it" in st["problems"]


def test_the_generating_heartbeat_is_written_only_while_an_engine_moves(tmp_path, monkeypatch):
    """Rank 0's heartbeat during generation carries progress: engines that stop moving leave it stale."""
    from rstar_hpc.config.stages import StageLimits
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.rollout.scheduler import StepScheduler
    from rstar_hpc.rollout.step import StepHooks, StepSpec

    clock = _Clock(monkeypatch)
    written = []
    hooks = StepHooks(beat=lambda text, **kw: written.append((clock.now, text)))
    s = StepScheduler(_Comm(clock, 3, []), _MPI, _sc(), RunPaths(tmp_path / "run"),
                      StepSpec("rl", 0, [], StageLimits(100, 4)), score=None, hooks=hooks)
    s.roster.engines = {e: Engine(e, state="generating") for e in (1, 2)}
    for second in range(60):
        clock.now += 1.0
        tokens = min(second, 20)   # both engines make tokens for 20 s, then their counters stand still
        for e in (1, 2):
            s.roster.heard(e)
            s.roster.on_report(e, {"tokens": tokens, "generating": 3})
        s.beat_if_moved()
    times = [t for t, _ in written]
    assert times and max(times) <= 1000 + 22 and "last progress 0s ago" in written[-1][1]   # silent once stopped
    assert len(times) >= 2 and all(b - a >= 10 for a, b in zip(times, times[1:]))          # throttled meanwhile


def test_a_late_joiner_gets_work_in_the_running_step(tmp_path, monkeypatch):
    """The scheduler's side: a HELLO in the step's loop adds the engine to admission and the step's engines; its
    start reports re-book nothing; the queue's next trajectories go to it."""
    from rstar_hpc.config.stages import StageLimits
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.rollout.mpi import TAG_WORK
    from rstar_hpc.rollout.scheduler import StepScheduler
    from rstar_hpc.rollout.step import StepSpec, WorkItem

    clock = _Clock(monkeypatch)
    t = clock.now
    step = {"stage": "rl", "step": 0}
    paths = RunPaths(tmp_path / "run")
    paths.create()
    comm = _Comm(clock, 3, [(t, 2, TAG_KV, {"starting": "loading the policy"}),
                            (t + 1, 2, TAG_HELLO, {"capacity_tokens": 1000, "policy_version": 1, **step})])
    items = [WorkItem(u, 0, [1] * 10, "p", "1") for u in "abcdef"]
    s = StepScheduler(comm, _MPI, _sc(max_trajectories_per_engine=2), paths,
                      StepSpec("rl", 0, items, StageLimits(100, 4)), score=None)
    s.roster.engines = {1: Engine(1, state="ready"), 2: Engine(2)}
    s.roster.step_of = ("rl", 0)
    s.prepare_admission({1: {"capacity_tokens": 1000}})
    s.dispatch(s.queue.admit(0.0))
    assert s.collect() and s.queue.admission.engines == [1]           # a start report: still loading
    clock.now += 1
    assert s.collect() and s.queue.admission.engines == [1, 2] and s.tally.engines == [1, 2]
    comm.sent.clear()
    s.dispatch(s.queue.admit(1.0))
    assert [(d, len(w)) for d, tag, w in comm.sent if tag == TAG_WORK] == [(2, 2)]


def test_a_load_stuck_across_steps_is_judged_while_the_next_step_waits_for_its_policy(monkeypatch):
    """A load still running past policy_load_timeout_s (carried from earlier steps) is lost while rank 0 waits for
    the next policy, not only at the next start; the start then leaves it out and does not report it twice."""
    from rstar_hpc.rollout.engines import JobEngines

    clock = _Clock(monkeypatch)
    t = clock.now
    job = JobEngines(loading={2: t - 100.0, 3: t - 10.0})
    comm = _Comm(clock, 4, [(t + 1, 1, TAG_HELLO, {"capacity_tokens": 1000}), (t + 1, 3, TAG_HELLO,
                                                                               {"capacity_tokens": 1000})])
    roster = EngineRoster(comm, _MPI, _sc(policy_load_timeout_s=90.0), job=job)
    lost = roster.judge_loads()
    assert [(x.rank, x.hung, x.starting) for x in lost] == [(2, True, True)] and "100s after START" in lost[0].why
    assert job.dead == {2} and job.loading == {3: t - 10.0} and comm.restarts == [(2, lost[0].why)]
    hello, during = roster.start([1, 3], {"step": 1}, lambda text: None)
    assert sorted(hello) == [1, 3] and during == [] and [x.rank for x in roster.lost] == [2]
