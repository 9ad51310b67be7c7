"""The sandbox service dies mid-step (SIGKILL of its process, a call running in it) and comes back, as the sbatch
supervisor restarts a dead sandbox step: the REAL agent loop and client against REAL service processes announced in
a run directory; only the engine is scripted.

- the call in flight on the killed service gets an infrastructure status (never `error`), so RoC does not charge
  the model for it (the trajectory counts one infra failure: algo.roc.drop_tool_infra_failures drops it);
- the trajectory goes on: its next call, made while no service is up, waits for the restarted one (announced under
  the same name, on a new port) and runs there;
- a call is ok only with the output of its own run."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rstar_hpc.config.rollout import AgentConfig
from rstar_hpc.exchange.tool_status import INFRA_TOOL_STATUSES
from rstar_hpc.rollout.agent import AgentLoop
from sandbox.client import SandboxClient
from tests.helpers.scripted import ANSWER, ScriptedEngine, call

pytestmark = [pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bwrap")]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _serve(run_dir: Path, name: str, since: float) -> tuple[subprocess.Popen, str]:
    """A service process announced as `name`; its address once its announcement (newer than `since`) is there."""
    proc = subprocess.Popen([sys.executable, "-m", "rstar_hpc", "sandbox", "serve", "--workers", "1", "--host",
                             "127.0.0.1", "--name", name, "--run-dir", str(run_dir)],
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    ann = run_dir / "rendezvous" / "sandbox" / f"{name}.json"
    deadline = time.monotonic() + 90
    while True:
        assert time.monotonic() < deadline and proc.poll() is None, f"service {name} did not start"
        try:
            rec = json.loads(ann.read_text())
            if rec["pid"] == proc.pid and rec["started_at"] >= since:
                return proc, f"127.0.0.1:{rec['port']}"
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass
        time.sleep(0.1)


def test_a_service_killed_mid_call_costs_one_infra_call_and_the_trajectory_goes_on(tok, tmp_path):
    run_dir = tmp_path / "run"
    first, first_addr = _serve(run_dir, "cpu1", 0.0)
    procs = [first]
    script = [call("import time\ntime.sleep(4)\nprint('first ran')"), call("print(6 * 7)"), ANSWER]
    engine = ScriptedEngine(tok, {"r": script})

    async def chaos(client: SandboxClient) -> str:
        # kill it once the first call is in flight there (sent, not answered)
        deadline = time.monotonic() + 60
        while not any(n.inflight for n in client.nodes.values()):
            assert time.monotonic() < deadline, "the first call was never sent"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        os.kill(first.pid, signal.SIGKILL)
        # the supervisor restarts the step only later: here, once the trajectory's next call, its attempts spent on
        # the dead address, waits for a service to come back
        while not any("waiting up to" in r.getMessage() for r in heard.records):
            assert time.monotonic() < deadline, "the trajectory's next call did not wait for a service"
            await asyncio.sleep(0.05)
        assert len(engine.calls) == 2   # the first call's turn is over: it got its result
        second, addr = await asyncio.to_thread(_serve, run_dir, "cpu1", time.time())
        procs.append(second)
        return addr

    heard = _Records()
    logging.getLogger("sandbox.client").addHandler(heard)

    async def go():
        # two attempts, not three: the backoff between them on the dead address would add ~15 s before the wait
        async with SandboxClient(run_dir=str(run_dir), service_wait_s=90.0, max_attempts=2) as client:
            agent = AgentLoop(engine, client, tok, AgentConfig(max_turns=6, max_prompt_length=1024,
                                                                max_response_length=1024, tool_output_max_chars=512))
            ids, text = agent.encode_prompt("What is 6 * 7?")
            res, addr = await asyncio.gather(agent.run(ids, "r", text), chaos(client))
            return res, addr

    try:
        res, second_addr = asyncio.run(go())
    finally:
        logging.getLogger("sandbox.client").removeHandler(heard)
        for p in procs:
            p.kill()
            p.wait()
    assert second_addr != first_addr
    assert res.finish_reason == "stop" and len(res.tool_calls) == 2, res
    lost, after = res.tool_calls
    assert lost.status in INFRA_TOOL_STATUSES and "first ran" not in lost.output, lost   # never `error`, never ok
    assert "Tool call failure" in lost.output, lost
    assert after.status == "ok" and "stdout: 42" in after.output, after   # ran on the restarted service
    assert res.infra_failures == 1   # what RoC's drop_tool_infra_failures reads
