"""`rollout.agent.tool_state`: the REAL sandbox service (bwrap) behind the REAL agent loop; only the engine is
scripted, since a random tiny model cannot write the code. With `session` a trajectory's cells share globals and
its session is released on every exit path; with `stateless` (the paper's) each call starts fresh."""
from __future__ import annotations

import asyncio
import shutil

import pytest

from rstar_hpc.config.rollout import AgentConfig
from rstar_hpc.rollout.agent import AgentLoop
from sandbox.client import SandboxClient
from sandbox.limits import Limits
from sandbox.server import Service
from tests.helpers.scripted import ANSWER, ScriptedEngine, call
from tests.helpers.sandbox_pools import TEST_LIMITS

pytestmark = [pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bwrap"), pytest.mark.slow]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


async def _with_service(body):
    svc = Service(Limits(**{**TEST_LIMITS, "num_workers": 1, "light_workers": 1}), host="127.0.0.1",
                  stats_interval_s=3600)
    await svc.start()
    try:
        async with SandboxClient([svc.address]) as client:
            return await body(svc, client)
    finally:
        await svc.close()


def _agent(tok, engine, client, tool_state: str, **kw) -> AgentLoop:
    cfg = dict(max_turns=6, max_prompt_length=1024, max_response_length=1024, tool_output_max_chars=512,
               tool_state=tool_state)
    return AgentLoop(engine, client, tok, AgentConfig(**{**cfg, **kw}))


async def _sessions_gone(svc: Service, timeout_s: float = 10.0) -> dict:
    """The service's session counters once it has forgotten every session (or the last seen at the deadline)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while True:
        snap = svc.pool.snapshot()
        if snap["sessions_known"] == 0 and snap["sessions_live"] == 0 or loop.time() > end:
            return snap
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("tool_state", ["session", "stateless"])
def test_turn_one_variable_is_visible_in_turn_three_only_with_session(tok, tool_state):
    script = [call("secret = 41"), call("other = 1"), call("print(secret + other)"), ANSWER]

    async def body(svc, client):
        agent = _agent(tok, ScriptedEngine(tok, {"r": script}), client, tool_state)
        ids, text = agent.encode_prompt("What is 41 + 1?")
        res = await agent.run(ids, "r", text)
        return res, await _sessions_gone(svc), svc.pool.snapshot()["session_states"]

    res, snap, states = asyncio.run(_with_service(body))
    assert res.finish_reason == "stop" and len(res.tool_calls) == 3, res
    # the tool's description in the system prompt tells the model which it gets
    assert ("persist between your calls" in res.prompt_text) == (tool_state == "session")
    assert ("fresh interpreter" in res.prompt_text) == (tool_state == "stateless")
    third = res.tool_calls[2]
    if tool_state == "session":
        assert third.status == "ok" and "stdout: 42" in third.output, third
        assert states.get("new") == 1 and states.get("live") == 2, states
    else:
        assert third.status == "error" and "NameError" in third.output, third
        assert not states, states   # no call ever named a session
    assert snap["sessions_known"] == 0 and snap["sessions_live"] == 0, snap   # released at the answer
    assert snap["sessions_released"] == (1 if tool_state == "session" else 0) and not snap["evictions"], snap


class _Failing(ScriptedEngine):
    """Turn 0 as scripted; turn 1 truncates, raises, or never returns (to be cancelled)."""

    def __init__(self, tok, mode: str):
        super().__init__(tok, {"r": [call("x = 1")]})
        self.mode = mode

    async def generate(self, prompt_ids, max_tokens, request_id, *, seed=None):
        if request_id.endswith("-t0"):
            return await super().generate(prompt_ids, max_tokens, request_id, seed=seed)
        if self.mode == "error":
            raise RuntimeError("engine died")
        if self.mode == "hang":
            await asyncio.sleep(3600)
        ids = self.tok.encode("<reason>" + "a b c " * 400, add_special_tokens=False)[:max_tokens]
        from rstar_hpc.rollout.agent import Generation
        return Generation(ids, [-1.0] * len(ids), "length")


@pytest.mark.parametrize("mode", ["truncated", "error", "cancelled", "cancelled_mid_tool_call"])
def test_the_session_is_released_on_every_exit_path(tok, mode):
    async def body(svc, client):
        if mode == "cancelled_mid_tool_call":
            engine = ScriptedEngine(tok, {"r": [call("x = 1"), call("import time\ntime.sleep(1.5)"), ANSWER]})
        else:
            engine = _Failing(tok, {"cancelled": "hang"}.get(mode, mode))
        agent = _agent(tok, engine, client, "session", max_response_length=300)
        ids, text = agent.encode_prompt("Compute 6 * 7.")
        task = asyncio.create_task(agent.run(ids, "r", text))
        outcome = None
        if mode.startswith("cancelled"):
            mid = mode == "cancelled_mid_tool_call"
            # the first cell ran (the session exists); mid: the second is running, released once it is over
            while not (svc.pool.snapshot()["calls"] >= 1 and (not mid or svc.pool.snapshot()["in_flight"])):
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)
            assert svc.pool.snapshot()["sessions_known"] == 1
            task.cancel()
        try:
            outcome = (await task).finish_reason
        except (RuntimeError, asyncio.CancelledError) as e:
            outcome = type(e).__name__
        return outcome, await _sessions_gone(svc)

    outcome, snap = asyncio.run(_with_service(body))
    want = {"truncated": "length", "error": "RuntimeError"}.get(mode, "CancelledError")
    assert outcome == want
    assert snap["sessions_known"] == 0 and snap["sessions_live"] == 0, snap


def test_closing_the_client_releases_sessions_nobody_released(tok):
    """An engine rank that stops with trajectories cancelled en masse closes its client: their sessions go too."""
    async def body(svc, client):
        await client.run("y = 2", session="orphan-1")
        await client.run("z = 3", session="orphan-2")
        assert svc.pool.snapshot()["sessions_known"] == 2
        await client.close()
        return await _sessions_gone(svc)

    snap = asyncio.run(_with_service(body))
    assert snap["sessions_known"] == 0 and snap["sessions_live"] == 0, snap
