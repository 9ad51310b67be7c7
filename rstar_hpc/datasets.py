"""What a stage trains or evaluates on: `stages[].data`, read in one place for every role.

    data: demo                   the built-in synthetic set (the CPU demo, rstar_hpc.demo_task: arithmetic in four
                                 levels with a distractor; easy ones can be done in the head, hard ones need the tool)
    data: demo-eval              the demo's held-out eval problems (DEMO_EVAL_PROMPTS, levels in equal shares)
    data: demo-256               the first 256 prompts of the demo set (e.g. a hard_subset stage's source)
    data: /lustre/rl-42k.parquet prompts with ground truth (rl, eval): a `question` and an `answer` column
    data: /lustre/rl.jsonl       the same as JSON lines; SFT stages take chat samples, {"messages": [...]}

Prompt rows may name the question `problem` or `prompt` and the answer `ground_truth` or `solution` (the public
datasets' spellings); `uid` or `id` names a prompt, else a hash of its question does. A bad row is an error that
names the file, the row and what is missing, before any engine starts.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

DEMO = "demo"
DEMO_PROMPTS = 4096   # the demo RL set: enough distinct prompts that a tiny run never repeats one within a stage
DEMO_EVAL_PROMPTS = 128   # 32 per level: pass@1's standard error ~0.03, small enough to see RL's gain on 2 cores
DEMO_SFT_SAMPLES = 20000   # > samples an SFT stage sees: fresh problems, nothing to memorise
QUESTION_KEYS = ("question", "problem", "prompt")
ANSWER_KEYS = ("answer", "ground_truth", "solution")
CHAT_ROLES = ("system", "user", "assistant", "tool")


class DatasetError(ValueError):
    """Stage data that cannot be used; the message names the file, the row and the fix."""


def demo_prompts(n: int, seed: int, *, held_out: bool = False) -> list[dict]:
    """n demo problems [{"uid", "question", "answer"}] (rstar_hpc.demo_task), levels in turn."""
    from rstar_hpc.demo_task import problems
    return problems(n, seed, held_out=held_out)


def is_demo(data: str | None) -> bool:
    return data is not None and (data == DEMO or data.startswith(DEMO + "-"))


def _demo_set(data: str, seed: int) -> list[dict]:
    rest = data[len(DEMO) + 1:] if data != DEMO else ""
    if not rest:
        return demo_prompts(DEMO_PROMPTS, seed)
    if rest == "eval":
        return demo_prompts(DEMO_EVAL_PROMPTS, seed, held_out=True)
    if rest.isdigit() and 0 < int(rest) <= DEMO_PROMPTS:
        return demo_prompts(int(rest), seed)
    raise DatasetError(f"{data!r}: not a demo set; use '{DEMO}', '{DEMO}-eval' or '{DEMO}-N' (the first N <= "
                       f"{DEMO_PROMPTS} demo prompts)")


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise DatasetError(f"{path}: no such data file; set stages[].data to a JSONL or Parquet file, or to "
                           f"'{DEMO}' for the built-in demo set")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:   # pyarrow raises several types for a bad file
            raise DatasetError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from e
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{n}: not a JSON object ({e}); each line is one prompt") from e
        if not isinstance(row, dict):
            raise DatasetError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def _field(row: dict, keys: tuple[str, ...], where: str, what: str) -> str:
    for k in keys:
        v = row.get(k)
        if v is not None and str(v).strip():
            return str(v)
    raise DatasetError(f"{where}: no {what} (looked for {', '.join(keys)}; the row has {sorted(row)})")


def load_prompts(stage, seed: int = 0, run_dir=None) -> list[dict]:
    """The prompts of an rl or hard_subset stage as [{"uid", "question", "answer"}], in file order; `run_dir`
    resolves `data: "@<stage>"` (the subset an earlier hard_subset stage wrote there)."""
    if stage.data is None:
        raise DatasetError(f"stage {stage.name!r} ({stage.kind}) has no data; set stages[].data to a JSONL or "
                           f"Parquet file of prompts with answers, or to '{DEMO}' for the built-in demo set")
    data = stage.data
    if data.startswith("@"):
        from rstar_hpc.exchange.rundir import RunPaths
        if run_dir is None:
            raise DatasetError(f"stage {stage.name!r}: data {data!r} is an earlier stage's output; it needs the "
                               f"run directory")
        path = RunPaths(run_dir).stage_data(data[1:])
        if not path.is_file():
            raise DatasetError(f"stage {stage.name!r}: {path} does not exist yet; stage {data[1:]!r} (hard_subset) "
                               f"writes it, and must be done before this stage starts")
        data = str(path)
    return load_prompt_file(data, seed)


def load_prompt_file(data: str, seed: int = 0) -> list[dict]:
    """Prompts with answers from a JSONL or Parquet file, or the demo set ('demo')."""
    if is_demo(data):
        return _demo_set(data, seed)
    path = Path(data)
    out, seen = [], set()
    for i, row in enumerate(_rows(path)):
        where = f"{path} row {i + 1}"
        question = _field(row, QUESTION_KEYS, where, "question")
        answer = _field(row, ANSWER_KEYS, where, "answer")
        uid = str(row.get("uid") or row.get("id") or hashlib.sha1(question.encode()).hexdigest()[:16])
        if uid in seen:
            raise DatasetError(f"{where}: prompt uid {uid!r} appears twice; uids name a GRPO group and must be "
                               f"unique (drop the duplicate or give it another uid)")
        seen.add(uid)
        out.append({"uid": uid, "question": question, "answer": answer})
    if not out:
        raise DatasetError(f"{path}: no prompts; a benchmark or prompt file needs rows with a question and an "
                           f"answer ({', '.join(QUESTION_KEYS)} / {', '.join(ANSWER_KEYS)})")
    return out


def load_sft_conversations(stage, seed: int = 0, system_prompt: str | None = None) -> list[list[dict]]:
    """The chat samples of an sft stage (lists of {"role", "content"} messages). The built-in demo traces carry
    `system_prompt` (rollout.agent.system_prompt; None: rStar2's), so they match what the rollouts show."""
    if stage.data is None:
        raise DatasetError(f"stage {stage.name!r} (sft) has no data; set stages[].data to a chat JSONL file "
                           f"({{\"messages\": [...]}} per line), or to '{DEMO}' for the built-in demo set")
    if stage.data == DEMO:
        from rstar_hpc.demo_task import sft_samples
        return [s["messages"] for s in sft_samples(DEMO_SFT_SAMPLES, seed, system=system_prompt)]
    return load_chat_jsonl(stage.data)


def load_chat_jsonl(path: str | Path) -> list[list[dict]]:
    """The conversations of a chat JSONL file, `{"messages": [{"role", "content"}, ...]}` per line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such SFT data file; generate the demo set with "
                                f"`python -m rstar_hpc.trainer.sft_data {path}`")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            msgs = json.loads(line)["messages"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: expected a JSON object with a 'messages' list ({e})") from e
        for m in msgs:
            if m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
                raise ValueError(f"{path}:{n}: message {m!r} needs role in {CHAT_ROLES} and string content")
        if not any(m["role"] == "assistant" for m in msgs):
            raise ValueError(f"{path}:{n}: no assistant message, nothing to train on")
        out.append(msgs)
    if not out:
        raise ValueError(f"{path}: empty SFT data file")
    return out
