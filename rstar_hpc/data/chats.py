"""Chat files (sft): OpenAI-style chats, JSONL or Parquet, as the [{"role", "content"}] messages the SFT trainer
renders (trainer.sft.render_segments: the chat template of models.chat_format).

A row is `{"messages": [...], "tools": [...]}` (tools optional; either may be a JSON string):
  - content is a string, null, or a list of text parts [{"type": "text", "text": ...}] (joined);
  - an assistant turn's `tool_calls` ([{"id", "type": "function", "function": {"name", "arguments"}}], arguments
    a JSON string or an object) are appended to its content in the rStar2 format, one
    <tool_call>{"name": ..., "arguments": {...}}</tool_call> block a call (chat_format.render_function_call),
    separated by newlines; a turn with only tool calls (content null or "") is those blocks;
  - `tool` turns carry a result; a `tool_call_id` must name a call of the assistant turn before them;
  - `tools` adds the "# Tools" section to the system turn (or to rStar2's system preamble when there is none), as
    the chat template does.
A malformed row (an unknown role, an assistant turn with nothing in it, a call whose arguments do not decode, no
assistant turn at all) is an error naming the file, the row and the message; nothing is dropped silently. In a
Parquet file a struct column holds every key any row has, so keys whose value is null are left out of tool call
arguments and tool schemas.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from rstar_hpc.data.files import DatasetError, Rows, content_text, maybe_json, read_rows
from rstar_hpc.models import chat_format as fmt

CHAT_ROLES = ("system", "user", "assistant", "tool")
CALLS, PARTS, TOOLS = "tool calls rendered", "content part lists joined", "tool schemas added to the system turn"


@dataclass
class ChatSet:
    rows: list[list[dict]]
    format: str
    read: int
    dropped: dict[str, int] = field(default_factory=dict)
    notes: dict[str, int] = field(default_factory=dict)


def _arguments(raw, where: str, parquet: bool) -> dict:
    args = raw
    if isinstance(raw, str):
        try:
            args = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: tool call arguments are not JSON ({e}): {raw[:80]!r}") from None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise DatasetError(f"{where}: tool call arguments must be a JSON object, not {type(args).__name__}")
    return _no_nulls(args) if parquet else args


def _no_nulls(value):
    """A Parquet struct's value without the keys other rows brought in (null here), at every depth."""
    if isinstance(value, dict):
        return {k: _no_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_no_nulls(v) for v in value]
    return value


def _call(call, where: str, parquet: bool) -> tuple[str | None, str]:
    """(the call's id, its rStar2 rendering)."""
    if not isinstance(call, dict):
        raise DatasetError(f"{where}: a tool call must be an object, not {type(call).__name__}")
    if call.get("type") not in (None, "function"):
        raise DatasetError(f"{where}: tool call of type {call.get('type')!r}; only function calls are supported")
    fn = maybe_json(call.get("function")) if call.get("function") is not None else call
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise DatasetError(f"{where}: a tool call without a function name; expected {{\"id\", \"type\": "
                           f"\"function\", \"function\": {{\"name\", \"arguments\"}}}}")
    return call.get("id"), fmt.render_function_call(name, _arguments(fn.get("arguments"), where, parquet))


def _message(m, where: str, pending: set, notes: Counter, parquet: bool) -> dict:
    if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
        raise DatasetError(f"{where}: message {m!r} needs a role in {CHAT_ROLES}")
    role = m["role"]
    if isinstance(m.get("content"), list):
        notes[PARTS] += 1
    text = content_text(m.get("content"), where)
    calls = maybe_json(m.get("tool_calls")) or []
    if calls and role != "assistant":
        raise DatasetError(f"{where}: a {role} turn with tool_calls; only assistant turns make tool calls")
    if not isinstance(calls, list):
        raise DatasetError(f"{where}: tool_calls must be a list of calls")
    if calls:
        rendered = [_call(c, where, parquet) for c in calls]
        pending.clear()
        pending.update(i for i, _ in rendered if i)
        text = "\n".join(([text] if text.strip() else []) + [r for _, r in rendered])
        notes[CALLS] += len(rendered)
    if role == "assistant" and not text.strip():
        raise DatasetError(f"{where}: an assistant turn with no content and no tool_calls; nothing to train on "
                           f"(remove the turn or give it its text)")
    call_id = m.get("tool_call_id")
    if role == "tool" and call_id and pending and call_id not in pending:
        raise DatasetError(f"{where}: tool_call_id {call_id!r} names no call of the assistant turn before it "
                           f"(its calls: {sorted(pending)})")
    return {"role": role, "content": text}


def chat_from_row(row: dict, where: str, *, parquet: bool = False, notes: Counter | None = None) -> list[dict]:
    """One row's conversation as rStar2 messages; DatasetError naming `where` and the message if malformed."""
    notes = Counter() if notes is None else notes
    msgs, tools = maybe_json(row.get("messages")), maybe_json(row.get("tools"))
    if not isinstance(msgs, list) or not msgs:
        raise DatasetError(f"{where}: expected a 'messages' list of chat messages (the row has {sorted(row)})")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DatasetError(f"{where}: 'tools' must be a list of tool schemas ({{\"type\": \"function\", "
                           f"\"function\": {{...}}}})")
    pending: set = set()
    out = [_message(m, f"{where} message {j + 1}", pending, notes, parquet) for j, m in enumerate(msgs)]
    if tools:
        tools = _no_nulls(tools) if parquet else tools
        notes[TOOLS] += 1
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": fmt.system_prompt(tools, preamble=out[0]["content"])}
        else:
            out.insert(0, {"role": "system", "content": fmt.system_prompt(tools)})
    if not any(m["role"] == "assistant" for m in out):
        raise DatasetError(f"{where}: no assistant message, nothing to train on")
    return out


def read_chat_file(path: str | Path | Rows, missing_hint: str = "") -> ChatSet:
    """The conversations of a chat JSONL or Parquet file."""
    src = path if isinstance(path, Rows) else read_rows(path, missing_hint)
    notes: Counter = Counter()
    out = []
    for i, (row, line) in enumerate(zip(src.rows, src.lines)):
        where = f"{src.path} row {i + 1}" if src.parquet else f"{src.path}:{line}"
        out.append(chat_from_row(row, where, parquet=src.parquet, notes=notes))
    if not out:
        raise DatasetError(f"{src.path}: empty SFT data file; it needs chats, {{\"messages\": [...]}} per row")
    return ChatSet(out, "openai-chat" if notes[CALLS] or notes[PARTS] else "chat", len(src.rows), {}, dict(notes))


def render_text(messages: list[dict]) -> str:
    """The conversation as the SFT trainer sees it: chat_format.CHAT_TEMPLATE rendered as the tokenizer's
    apply_chat_template renders it (tests/trainer/test_sft checks the trainer's pieces join to the same text)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(fmt.CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=False)
