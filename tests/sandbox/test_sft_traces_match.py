"""The SFT traces quote tool messages token for token as a rollout shows them: the real sandbox runs the traces'
programs and renders their results, and the traces' text must be the same (a blank line or a missing traceback
line is a train/rollout mismatch the model pays for when it copies the result into its answer)."""
from __future__ import annotations

import json
import random
import re
import subprocess
import sys

from rstar_hpc.data.demo_task import sft_sample
from rstar_hpc.synthetic.sft_chats import make_sample


def _rendered(codes: list[str], sessions: list[str | None] | None = None) -> list[str]:
    sessions = sessions or [None] * len(codes)
    lines = "".join(json.dumps({"code": c, "session": s}) + "\n" for c, s in zip(codes, sessions))
    out = subprocess.run([sys.executable, "-m", "rstar_hpc", "sandbox", "exec", "--render", "--workers", "1"],
                         input=lines, capture_output=True, text=True, timeout=120, check=True).stdout
    return [json.loads(line)["text"] for line in out.splitlines()]


def _timeless(text: str) -> str:
    return re.sub(r"execution time: \d+\.\d\ds$", "execution time: T", text)


def _calls_and_tool_texts(messages: list[dict]) -> list[tuple[str, str]]:
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            call = messages[i - 1]["content"]
            code = json.loads(call[call.index("<tool_call>") + len("<tool_call>"):call.index("</tool_call>")])
            out.append((code["arguments"]["code"], m["content"]))
    return out


def test_sft_tool_messages_are_what_the_sandbox_renders():
    rng = random.Random(7)
    pairs = []
    for _ in range(40):
        pairs += _calls_and_tool_texts(sft_sample(rng)["messages"])
    pairs += _calls_and_tool_texts(make_sample(rng)["messages"])
    assert any(t.startswith("Tool call failure") for _, t in pairs) and any("success" in t for _, t in pairs)
    rendered = _rendered([code for code, _ in pairs])
    for (code, text), real in zip(pairs, rendered):   # the time is the call's own (0.00s, or 0.01s on a busy node)
        assert _timeless(text) == _timeless(real), (code, text, real)


def test_noisy_traces_retry_from_the_session_the_failed_call_left():
    # the noisy variant's retry is `print(x)` alone: in one sandbox session per trace (rollout.agent.tool_state:
    # session) it prints what the failed call computed, exactly as the trace quotes it
    rng = random.Random(3)
    pairs, sessions = [], []
    for i in range(40):
        mine = _calls_and_tool_texts(sft_sample(rng, noisy=True)["messages"])
        pairs += mine
        sessions += [f"trace-{i}"] * len(mine)
    assert sum(code == "print(x)" for code, _ in pairs) >= 10   # retries that copy no number
    assert any(t.startswith("Tool call failure") for _, t in pairs)
    rendered = _rendered([code for code, _ in pairs], sessions)
    for (code, text), real in zip(pairs, rendered):
        assert _timeless(text) == _timeless(real), (code, text, real)
