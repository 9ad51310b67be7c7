"""The agent loop's logic against a scripted engine (a test double for the loop only; test_e2e uses vLLM)."""
from __future__ import annotations

import asyncio
import json

import pytest

from rstar_hpc.models.chat_format import IM_END, render_tool_call
from rstar_hpc.models.chat_format import parse_tool_calls
from rstar_hpc.rollout.agent import PromptTooLong
from tests.helpers.scripted import ANSWER, FakeTools, ScriptedEngine, call, loop


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def run(agent, question="Compute 6 * 7.", rid="a"):
    ids, text = agent.encode_prompt(question)
    return asyncio.run(agent.run(ids, rid, text)), ids


def test_tool_turn_then_answer(tok):
    eng = ScriptedEngine(tok, {"a": [call("print(6 * 7)"), ANSWER]})
    tools = FakeTools()
    res, prompt = run(loop(tok, eng, tools))
    assert res.finish_reason == "stop" and tools.codes == ["print(6 * 7)"]
    assert [t.role for t in res.turns] == ["assistant", "tool", "assistant"]
    a1, tool, a2 = res.turns
    assert res.loss_mask == [1] * (a1.end - a1.start) + [0] * (tool.end - tool.start) + [1] * (a2.end - a2.start)
    assert all(lp == 0.0 for lp in res.logprobs[tool.start:tool.end])
    assert res.logprobs[a1.start] == -0.5 and res.logprobs[a2.start] == -0.5
    # the tool turn is exactly the chat template's user turn + the next prefilled generation prompt
    assert tool.text.startswith("\n<|im_start|>user\n<tool_response>\nTool call success\nstdout: ran 1\n")
    assert tool.text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n<reason>")
    # turn 2 continues the exact token ids of turn 1 (prefix-cache hit), and gets what is left of the budget
    (_, ctx1, max1, _), (_, ctx2, max2, _) = eng.calls
    assert ctx1 == prompt and ctx2 == prompt + res.response_ids[:tool.end]
    assert max1 == 512 and max2 == 512 - tool.end
    assert res.tool_calls[0].status == "ok" and res.tool_calls[0].turn == 0
    assert json.loads(res.tool_calls[0].arguments) == {"code": "print(6 * 7)", "input": ""}


def test_malformed_and_unknown_calls_are_answered_not_dropped(tok):
    bad_json = "<reason>x <tool_call>{\"name\": \"python_code_with_standard_io\", \"arguments\": {</tool_call>" + IM_END
    unknown = '<reason>x <tool_call>{"name": "shell", "arguments": {"code": "ls"}}</tool_call>' + IM_END
    eng = ScriptedEngine(tok, {"a": [bad_json, unknown, ANSWER]})
    tools = FakeTools()
    res, _ = run(loop(tok, eng, tools))
    assert res.finish_reason == "stop" and tools.codes == []
    assert [c.status for c in res.tool_calls] == ["parse_error", "invalid_request"]
    assert res.tool_calls[0].output.startswith("Failed to decode tool call:")
    assert "unknown tool 'shell'" in res.tool_calls[1].output
    assert "Failed to decode tool call" in res.turns[1].text   # the model sees the failure


def test_parse_tool_calls_edge_cases():
    assert parse_tool_calls("no call <answer>1</answer>") is None
    assert parse_tool_calls("<tool_call>{\"name\": 1}") is None            # unclosed: the rollout ends
    double = json.dumps({"name": "python_code_with_standard_io", "arguments": json.dumps({"code": "1", "input": ""})})
    (c,) = parse_tool_calls(f"<tool_call>{double}</tool_call>")
    assert c.error is None and c.code == "1"
    (c,) = parse_tool_calls('<tool_call>{"name": "python_code_with_standard_io", "arguments": {"code": 3}}'
                            '</tool_call>')
    assert c.error_status == "invalid_request"


def test_max_turns(tok):
    eng = ScriptedEngine(tok, {"a": [call(f"print({i})") for i in range(5)]})
    tools = FakeTools()
    res, _ = run(loop(tok, eng, tools, max_turns=3))
    assert res.finish_reason == "max_turns" and res.num_assistant_turns == 3
    assert len(tools.codes) == 2 and res.turns[-1].role == "assistant"   # the last turn's call is not run


def test_length_budget_counts_tool_tokens(tok):
    long_answer = "<reason>" + "think " * 400 + IM_END
    eng = ScriptedEngine(tok, {"a": [call("print(1)"), long_answer]})
    res, _ = run(loop(tok, eng, max_response_length=200))
    assert res.finish_reason == "length" and len(res.response_ids) == 200
    assert eng.calls[1][2] == 200 - res.turns[1].end


def test_tool_overflow_drops_the_response(tok):
    eng = ScriptedEngine(tok, {"a": [call("print(1)")]})
    res, _ = run(loop(tok, eng, FakeTools(stdout="y" * 200), max_response_length=120))
    assert res.finish_reason == "tool_overflow"
    assert [t.role for t in res.turns] == ["assistant"] and res.loss_mask[-1] == 1
    assert len(res.tool_calls) == 1   # it ran (and is recorded) but its tokens would not fit


def test_parallel_calls_limit_and_truncation(tok):
    two = "<reason>a " + render_tool_call("print(1)") + render_tool_call("raise ValueError") + IM_END
    eng = ScriptedEngine(tok, {"a": [two, two, ANSWER]})
    tools = FakeTools(stdout="H" * 300 + "T" * 300)
    res, _ = run(loop(tok, eng, tools, max_parallel_calls=1, max_response_length=1500, tool_output_max_chars=64))
    assert [c.status for c in res.tool_calls[:2]] == ["ok", "invalid_request"]
    assert "at most 1 tool call" in res.tool_calls[1].output
    out = res.tool_calls[0].output
    assert len(out) <= 64 + len("...(truncated)...") and "...(truncated)..." in out
    assert out.startswith("Tool call success") and out.endswith("execution time: 0.02s")
    assert res.tool_calls[0].output_chars > 600

    eng = ScriptedEngine(tok, {"a": [two, ANSWER]})
    tools = FakeTools()
    res, _ = run(loop(tok, eng, tools, max_parallel_calls=2))
    assert sorted(tools.codes) == ["print(1)", "raise ValueError"]
    assert [c.status for c in res.tool_calls] == ["ok", "error"]
    assert res.turns[1].text.count("<tool_response>") == 2   # merged into one user turn


def test_tool_wait_does_not_block_other_trajectories(tok):
    # a: one slow tool call (1 s); b: five quick turns. b must finish while a waits.
    eng = ScriptedEngine(tok, {"a": [call("print(1)"), ANSWER],
                               "b": [call("print(2)")] * 4 + [ANSWER]}, delay_s=0.01)

    class PerCodeTools(FakeTools):
        async def run(self, code, stdin="", session=None, timeout_s=None):
            await asyncio.sleep(1.0 if code == "print(1)" else 0.01)
            return {"status": "ok", "stdout": "1", "stderr": "", "wall_s": 0.0}

    agent = loop(tok, eng, PerCodeTools(), max_turns=6, max_response_length=1024)
    ids, _ = agent.encode_prompt("q")

    async def both():
        t0 = asyncio.get_running_loop().time()
        done = {}

        async def one(rid):
            r = await agent.run(ids, rid)
            done[rid] = asyncio.get_running_loop().time() - t0
            return r
        ra, rb = await asyncio.gather(one("a"), one("b"))
        return ra, rb, done

    ra, rb, done = asyncio.run(both())
    assert ra.finish_reason == rb.finish_reason == "stop" and rb.num_assistant_turns == 5
    assert done["b"] < 0.6 < done["a"]
    assert ra.timings.tool_s >= 1.0 and rb.timings.tool_s < 0.5


def test_overlong_prompt_is_a_clear_error(tok):
    agent = loop(tok, ScriptedEngine(tok, {}), max_prompt_length=64)
    with pytest.raises(PromptTooLong, match="max_prompt_length=64"):
        agent.encode_prompt("Compute 6 * 7.")


def test_the_system_prompt_knob_replaces_rstar2s(tok):
    from rstar_hpc.models.chat_format import render_prompt

    _, full = loop(tok, ScriptedEngine(tok, {})).encode_prompt("Compute 6 * 7.")
    _, short = loop(tok, ScriptedEngine(tok, {}), system_prompt="").encode_prompt("Compute 6 * 7.")
    assert "<tools>" in full and "<tools>" not in short and short == render_prompt("Compute 6 * 7.", system="")
    assert short.startswith("<|im_start|>system\n<|im_end|>\n<|im_start|>user\n")


def test_unreachable_sandbox_is_a_failure_response(tok):
    class Down(FakeTools):
        async def run(self, code, stdin="", session=None, timeout_s=None):
            raise ConnectionRefusedError("no sandbox")

    eng = ScriptedEngine(tok, {"a": [call("print(1)"), ANSWER]})
    res, _ = run(loop(tok, eng, Down()))
    assert res.finish_reason == "stop" and res.tool_calls[0].status == "unavailable" and res.infra_failures == 1
    assert res.tool_calls[0].output.startswith("Tool call failure")


def test_a_cell_that_failed_on_a_session_the_service_lost_is_an_infrastructure_failure(tok):
    """Its service died and the session moved (state "lost": fresh globals): a NameError there is not the model's."""
    class Lost(FakeTools):
        async def run(self, code, stdin="", session=None, timeout_s=None):
            return {"status": "error", "stdout": "", "stderr": "NameError: name 'x' is not defined", "wall_s": 0.01,
                    "session": {"id": session, "state": "lost"}}

    eng = ScriptedEngine(tok, {"a": [call("print(x)"), ANSWER]})
    res, _ = run(loop(tok, eng, Lost()))
    assert res.tool_calls[0].status == "internal_error" and res.infra_failures == 1
    assert "NameError" in res.tool_calls[0].output   # the model still sees what happened


def test_code_errors_are_not_infrastructure_failures(tok):
    eng = ScriptedEngine(tok, {"a": [call("raise ValueError('boom')"), ANSWER]})
    res, _ = run(loop(tok, eng))
    assert res.tool_calls[0].status == "error" and res.infra_failures == 0


def test_seeds_per_turn_and_progress_reports(tok):
    from rstar_hpc.rollout.step import request_seed

    eng = ScriptedEngine(tok, {"a": [call("print(1)"), call("print(2)"), ANSWER]})
    agent = loop(tok, eng)
    ids, text = agent.encode_prompt("Compute 6 * 7.")
    seen: list[int] = []
    seed = request_seed(0, "rl", 3, "p1", 2)
    res = asyncio.run(agent.run(ids, "a", text, seed=seed, progress=seen.append))
    assert eng.seeds == [seed, seed + 1, seed + 2]
    assert seen == [len(ids) + res.turns[1].end, len(ids) + res.turns[3].end]   # after each tool turn
    # the same trajectory gets the same seed anywhere; any other coordinate changes it
    assert request_seed(0, "rl", 3, "p1", 2) == seed
    assert len({seed, request_seed(1, "rl", 3, "p1", 2), request_seed(0, "rl", 4, "p1", 2),
                request_seed(0, "rl", 3, "p2", 2), request_seed(0, "rl", 3, "p1", 3)}) == 5
    asyncio.run(agent.run(ids, "a", text))
    assert eng.seeds[-3:] == [None] * 3   # no seed: the engine's own generator


def test_the_trajectory_message_travels_pickled_and_scores_into_a_row(tok):
    """Engine rank -> rank 0 -> writer: the agent loop's output in a TrajectoryResult, pickled as mpi4py sends it,
    scored into a valid schema row with the same tokens, turns and tool calls."""
    import pickle

    from rstar_hpc.config.algo import RewardConfig, RoCConfig
    from rstar_hpc.rollout.messages import TrajectoryResult
    from rstar_hpc.rollout.step import Scorer, WorkItem

    res, prompt = run(loop(tok, ScriptedEngine(tok, {"a": [call("print(6 * 7)"), ANSWER]})))
    msg = pickle.loads(pickle.dumps(TrajectoryResult("a", 0, 3, 1, 0, res)))
    assert msg.key == ("a", 0) and not msg.paused and msg.output == res
    it = WorkItem("a", 0, prompt, res.prompt_text, "42")
    row = Scorer("r", RewardConfig(), RoCConfig())("rl", 3, it, msg, queue_s=0.5)
    assert row.response_ids == res.response_ids and row.turns == res.turns and row.tool_calls == res.tool_calls
    assert row.reward == 1.0 and row.timings.queue_s == 0.5 and res.timings.queue_s == 0.0
    assert row.token_policy_versions is None   # one version throughout: the column stays null
