"""Stage data: the demo set, JSONL and Parquet prompt files, and the errors that name the bad row."""
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rstar_hpc.config import load_config
from rstar_hpc.datasets import DEMO_EVAL_PROMPTS, DatasetError, load_prompts, load_sft_conversations
from rstar_hpc.demo_task import DIRECT_SHARE, TYPO_SHARE, evaluate, level_of, sft_samples


def _stage(tmp_path, data, kind="rl", **extra):
    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}",
                                   f"stages=[{json.dumps({'name': 's', 'kind': kind, 'data': data, **extra})}]"])
    return cfg.stage("s")


def test_demo_sets_are_deterministic(tmp_path):
    a, b = load_prompts(_stage(tmp_path, "demo")), load_prompts(_stage(tmp_path, "demo"))
    assert a == b and len({p["uid"] for p in a}) == len(a) > 1000
    for p in a[:8]:   # "... Compute <expr>. ..." with a distractor sentence; the answer is the expression's value
        expr = p["question"].split("Compute ", 1)[1].split(".", 1)[0]
        assert evaluate(expr) == int(p["answer"]) == eval(expr)   # noqa: S307 (digits and + * only)
    assert {level_of(p["uid"]) for p in a[:8]} == {1, 2, 3, 4}
    held = load_prompts(_stage(tmp_path, "demo-eval"))
    hard = [{p["question"] for p in ps if level_of(p["uid"]) >= 3} for ps in (held, a)]   # easy ones repeat
    assert len(held) == DEMO_EVAL_PROMPTS and hard[0] and not hard[0] & hard[1]
    assert load_prompts(_stage(tmp_path, "demo-64")) == a[:64]
    with pytest.raises(DatasetError, match="not a demo set"):
        load_prompts(_stage(tmp_path, "demo-x"))
    chats = load_sft_conversations(_stage(tmp_path, "demo", kind="sft"))
    assert chats[0][-1]["role"] == "assistant" and "<answer>" in chats[0][-1]["content"]
    assert "<tools>" in chats[0][0]["content"]   # rStar2's system prompt unless the rollouts use another one
    short = load_sft_conversations(_stage(tmp_path, "demo", kind="sft"), 0, "")
    assert short[0][0] == {"role": "system", "content": ""} and short[0][1:] == chats[0][1:]


def test_demo_sft_traces_mix_direct_answers_tool_calls_and_typos():
    """The SFT set leaves RL room: some traces answer in the head, some fix a failed first call."""
    samples = sft_samples(400, seed=0)
    tool_turns = [sum(m["role"] == "tool" for m in s["messages"]) for s in samples]
    shares = [tool_turns.count(k) / len(samples) for k in (0, 1, 2)]
    assert abs(shares[0] - DIRECT_SHARE) < 0.08 and abs(shares[2] - TYPO_SHARE) < 0.08, shares
    for s in samples:
        last = s["messages"][-1]["content"]
        assert last.endswith(f"<answer>\\boxed{{{s['answer']}}}</answer>")
        tools = [m["content"] for m in s["messages"] if m["role"] == "tool"]
        assert all(t.startswith("Tool call failure") for t in tools[:-1])
        assert not tools or tools[-1] == f"Tool call success\nstdout: {s['answer']}\n\nexecution time: 0.00s"  # as rendered


def test_jsonl_and_parquet_with_the_public_datasets_spellings(tmp_path):
    rows = [{"id": 7, "problem": "1+1?", "ground_truth": 2}, {"question": "2+2?", "answer": "4"}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    pq.write_table(pa.Table.from_pylist([{"problem": r.get("problem") or r["question"],
                                          "solution": str(r.get("ground_truth") or r["answer"])} for r in rows]),
                   tmp_path / "p.parquet")
    j = load_prompts(_stage(tmp_path, str(tmp_path / "p.jsonl")))
    p = load_prompts(_stage(tmp_path, str(tmp_path / "p.parquet")))
    assert [(r["question"], r["answer"]) for r in j] == [(r["question"], r["answer"]) for r in p] == \
        [("1+1?", "2"), ("2+2?", "4")]
    assert j[0]["uid"] == "7" and j[1]["uid"] == p[1]["uid"]   # no uid: the question's hash, the same in both


@pytest.mark.parametrize(("content", "match"), [
    ('{"question": "x"}\n', r"row 1: no answer \(looked for answer, ground_truth, solution"),
    ('{"question": "x", "answer": "1"}\nnot json\n', r":2: not a JSON object"),
    ('[1, 2]\n', "expected a JSON object, got list"),
    ('{"uid": "a", "question": "x", "answer": "1"}\n{"uid": "a", "question": "y", "answer": "2"}\n',
     "uid 'a' appears twice"),
    ('\n', "no prompts"),
])
def test_bad_rows_are_named(tmp_path, content, match):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(DatasetError, match=match):
        load_prompts(_stage(tmp_path, str(tmp_path / "bad.jsonl")))


def test_missing_data_is_an_error_not_a_silent_default(tmp_path):
    with pytest.raises(DatasetError, match="has no data; set stages\\[\\].data"):
        load_prompts(_stage(tmp_path, None))
    with pytest.raises(DatasetError, match="no such data file"):
        load_prompts(_stage(tmp_path, str(tmp_path / "nope.parquet")))
    (tmp_path / "broken.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        load_prompts(_stage(tmp_path, str(tmp_path / "broken.parquet")))
    with pytest.raises(DatasetError, match="sft\\) has no data"):
        load_sft_conversations(_stage(tmp_path, None, kind="sft"))


def test_a_hard_subset_not_built_yet_says_which_stage_builds_it(tmp_path):
    cfg = load_config("qwen3-14b", [f"run.root={tmp_path}"])
    with pytest.raises(DatasetError, match="stage 'hard' \\(hard_subset\\) writes it"):
        load_prompts(cfg.stage("rl-hard"), run_dir=cfg.run.dir)


def test_rollout_cli_refuses_bad_data_before_starting_ranks(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"question": "x"}\n')
    r = subprocess.run([sys.executable, "-m", "rstar_hpc", "rollout", "--step", "0", f"run.root={tmp_path}",
                        f"stages.rl-short.data={tmp_path / 'bad.jsonl'}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "bad.jsonl row 1: no answer" in r.stderr and "Traceback" not in r.stderr
