"""`rstar-hpc data show|check` and `config validate` on data files: what a user sees of how a file is read, the exit
codes scripts rely on, and `rstar-hpc eval --data` on an rStar-prepared Parquet."""
from __future__ import annotations

import json

import pytest
from tests.helpers.datafiles import openai_chat, verl_row, write_jsonl, write_parquet

from rstar_hpc.cli import main
from rstar_hpc.cli.exit_codes import EXIT_CONFIG
from rstar_hpc.config import load_config
from rstar_hpc.data.prompts import REPEATS
from rstar_hpc.eval import compose as c
from rstar_hpc.models import chat_format as fmt

RATIONALE = "First we add the two numbers together and then we divide the result by two, which gives the answer."


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_show_json_of_a_dapo_parquet(tmp_path, capsys):
    rows = [verl_row(10 * k + i, f"Problem {k}", str(k), system="sys") for i in range(3) for k in range(2)]
    f = write_parquet(tmp_path / "dapo.parquet", rows)
    code, out, _ = _run(["data", "show", str(f), "--json", "-n", "2"], capsys)
    assert code == 0
    d = _last_json(out)
    assert {"format", "rows", "dropped", "sample"} <= set(d)
    assert (d["format"], d["rows"], d["dropped"], d["kind"]) == ("verl", 2, {REPEATS: 4}, "rl")
    assert d["sample"] == [{"uid": "0", "question": "Problem 0", "answer": "0"},
                           {"uid": "10", "question": "Problem 1", "answer": "1"}]
    code, out, _ = _run(["data", "show", str(f)], capsys)   # the human form says the same
    assert code == 0 and "format:  verl" in out and f"4 {REPEATS}" in out and "Problem 1" in out


def test_show_an_openai_tool_calls_sft_file(tmp_path, capsys):
    f = write_jsonl(tmp_path / "chats.jsonl", [openai_chat(), openai_chat(content="Let me compute it.")])
    code, out, _ = _run(["data", "show", str(f), "--json"], capsys)   # kind guessed from the columns
    d = _last_json(out)
    assert code == 0 and (d["kind"], d["format"], d["rows"], d["dropped"]) == ("sft", "openai-chat", 2, {})
    text = d["sample"][0]["text"]
    assert fmt.render_tool_call("print(12 * 13)") in text
    assert "<|im_start|>user\n<tool_response>\n156\n</tool_response><|im_end|>" in text
    assert "<tools>" in text and text.endswith("<answer>\\boxed{156}</answer><|im_end|>\n")
    assert "Let me compute it.\n<tool_call>" in d["sample"][1]["text"]


def test_check_exit_codes(tmp_path, capsys):
    good = write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": "q", "answer": "so\n#### 72"}])
    code, out, _ = _run(["data", "check", str(good)], capsys)
    assert code == 0 and "format gsm8k, 1 rows" in out
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": RATIONALE}])
    code, _, err = _run(["data", "check", str(bad)], capsys)
    assert code == EXIT_CONFIG and "bad.jsonl row 1: column 'answer' holds a worked solution" in err, err
    code, _, err = _run(["data", "check", str(tmp_path / "nope.parquet")], capsys)
    assert code == EXIT_CONFIG and "no such data file" in err
    code, _, err = _run(["data", "check", str(good), "--kind", "sft"], capsys)   # a prompt file is no chat file
    assert code == EXIT_CONFIG and "expected a 'messages' list" in err
    assert _run(["data", "check", "demo-eval"], capsys)[0] == 0


def test_config_validate_reads_every_data_file_it_names(tmp_path, capsys):
    good = write_parquet(tmp_path / "rl.parquet", [verl_row(0, "q", "1")])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": RATIONALE}])
    sft = write_jsonl(tmp_path / "sft.jsonl", [openai_chat()])
    base = ["config", "validate", "tiny-cpu", f"stages.sft.data={sft}", f"stages.rl-short.data={good}"]
    code, out, err = _run(base, capsys)
    assert code == 0, err
    assert f"stages.rl-short.data: {good}: rl, format verl, 1 rows" in out and "stages.sft.data" in out
    code, out, err = _run(base + [f"stages.rl-long.data={bad}", f"stages.eval.benchmarks={{b: {tmp_path}/no.jsonl}}"],
                          capsys)
    assert code == EXIT_CONFIG
    assert "1 data file(s) cannot be used" in err and f"stages.rl-long.data: {bad} row 1: column 'answer'" in err
    # a file this machine does not have is named, not refused (a recipe's placeholder; launch refuses it)
    assert f"stages.eval.benchmarks.b: {tmp_path}/no.jsonl: not on this machine" in err
    assert _run(base + [f"stages.rl-long.data={bad}", "--no-data"], capsys)[0] == 0
    load_config("tiny-cpu", [f"stages.rl-long.data={tmp_path}/absent.jsonl"])   # loading a config reads no data


def test_eval_takes_an_rstar_prepared_parquet_unchanged(tmp_path):
    from rstar_hpc import pipeline

    f = write_parquet(tmp_path / "test.parquet", [verl_row(0, "Find x.", "204"),
                                                  verl_row(1, "Find y.", "25", system="Be brief.")])
    benches = c.parse_benchmarks([f"aime24={f}"])
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "max_position_embeddings": 4096, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "vocab_size": 512}))
    (hf / "model.safetensors").write_bytes(b"")
    (hf / "tokenizer.json").write_text("{}")
    cfg = c.compose("tiny-cpu", [], c.resolve_policy(str(hf)), benches, tmp_path / "out",
                    protocol={"k": 2, "max_response_length": 3000}, prompts_per_step=8)
    prompts = pipeline.stage_prompts(cfg, cfg.stage(c.STAGE))
    assert [(p["uid"], p["question"], p["answer"]) for p in prompts] == [("aime24/0", "Find x.", "204"),
                                                                          ("aime24/1", "Find y.", "25")]
    assert not any("system" in p for p in prompts)   # dropped by default; `eval --keep-system` keeps it
    kept = c.compose("tiny-cpu", [], c.resolve_policy(str(hf)), benches, tmp_path / "out2",
                     protocol={"k": 2, "max_response_length": 3000}, prompts_per_step=8, keep_system=True)
    assert [p.get("system") for p in pipeline.stage_prompts(kept, kept.stage(c.STAGE))] == [None, "Be brief."]
    with pytest.raises(Exception, match="column 'answer' holds a worked solution"):
        c.parse_benchmarks([str(write_jsonl(tmp_path / "r.jsonl", [{"question": "q", "answer": RATIONALE}]))])
