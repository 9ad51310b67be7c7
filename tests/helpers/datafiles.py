"""Data files the data tests write: rows as the public recipes' tools write them (no downloads)."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from rstar_hpc.models import chat_format as fmt


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def verl_row(i: int, question: str, answer: str, system: str | None = None) -> dict:
    """A row as microsoft/rStar's data_preprocess/*.py writes it (the verl schema)."""
    prompt = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return {"data_source": "rstar_HuggingFaceH4/aime_2024", "agent_name": "rstar2_agent", "prompt": prompt,
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "test", "index": i, "answer": answer, "question": question,
                           "need_tools_kwargs": False}}


CALL = {"id": "call_1", "type": "function",
        "function": {"name": fmt.TOOL_NAME, "arguments": json.dumps({"code": "print(12 * 13)", "input": ""})}}


def openai_chat(content=None, call=CALL, tool_call_id="call_1") -> dict:
    """An OpenAI-style chat with a tool call (content null or text), its tool turn and the answer."""
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "Compute "}, {"type": "text",
                                                                                            "text": "12 * 13."}]},
                         {"role": "assistant", "content": content, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": tool_call_id, "content": "156"},
                         {"role": "assistant", "content": "<answer>\\boxed{156}</answer>"}],
            "tools": [fmt.TOOL_SCHEMA]}
