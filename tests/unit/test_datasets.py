"""Stage data: the demo set, JSONL and Parquet prompt files in the layouts users have (verl, DAPO, GSM8K, MATH),
OpenAI-style chat files, and the errors that name the bad row."""
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tests.helpers.datafiles import CALL, openai_chat, verl_row, write_jsonl, write_parquet

from rstar_hpc.cli.exit_codes import EXIT_REFUSED
from rstar_hpc.config import load_config
from rstar_hpc.data.answers import ground_truth
from rstar_hpc.data.prompts import REPEATS, SYSTEM_UNUSED, read_prompt_file
from rstar_hpc.data.sets import (DEMO_EVAL_PROMPTS, DatasetError, load_chat_jsonl, load_prompt_file, load_prompts,
                                load_sft_conversations)
from rstar_hpc.models import chat_format as fmt
from rstar_hpc.data.demo_task import (DIRECT_SHARE, NOISY_DIRECT_SHARE, NOISY_TYPO_SHARE, TYPO_SHARE, evaluate,
                                     level_of, sft_samples)


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


def test_the_noisy_variant_errs_in_most_traces_and_retries_without_copying_a_number(tmp_path):
    """demo-noisy: more than half the traces misspell the print and retry with `print(x)` (the session keeps x);
    its prompts are the demo set's."""
    chats = load_sft_conversations(_stage(tmp_path, "demo-noisy", kind="sft"), 0, "")
    tool_turns = [sum(m["role"] == "tool" for m in c) for c in chats[:1000]]
    shares = [tool_turns.count(k) / 1000 for k in (0, 1, 2)]
    assert abs(shares[0] - NOISY_DIRECT_SHARE) < 0.05 and abs(shares[2] - NOISY_TYPO_SHARE) < 0.05, shares
    retries = [c for c, n in zip(chats, tool_turns) if n == 2]
    for c in retries[:50]:
        first, second = (m["content"] for m in c if m["role"] == "assistant" and "<tool_call>" in m["content"])
        assert "prnt(x)" in first and '"code": "print(x)"' in second
    assert chats[0][1:] != load_sft_conversations(_stage(tmp_path, "demo", kind="sft"), 0, "")[0][1:]
    assert load_prompts(_stage(tmp_path, "demo-noisy")) == load_prompts(_stage(tmp_path, "demo"))


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
    assert r.returncode == EXIT_REFUSED, r.stderr[-2000:]   # the role's: a launcher does not start it again
    assert "bad.jsonl row 1: no answer" in r.stderr and "Traceback" not in r.stderr


# -- the layouts users have --------------------------------------------------------------------------------------

def test_an_rstar_prepared_verl_parquet_is_read_as_it_is(tmp_path):
    f = write_parquet(tmp_path / "aime.parquet", [verl_row(0, "Find x.", "204"), verl_row(1, "Find y.", "25"),
                                                  verl_row(2, fmt.USER_PREFIX + "Find z.", "7")])
    got = read_prompt_file(f)
    assert got.format == "verl" and got.dropped == {}
    assert got.rows == [{"uid": "0", "question": "Find x.", "answer": "204"},
                        {"uid": "1", "question": "Find y.", "answer": "25"},
                        {"uid": "2", "question": "Find z.", "answer": "7"}]   # the renderer adds the prefix itself
    assert load_prompt_file(str(f)) == got.rows


def test_a_verl_system_turn_is_dropped_unless_kept(tmp_path):
    f = write_parquet(tmp_path / "s.parquet", [verl_row(i, f"q{i}", str(i), system="Think step by step.")
                                               for i in range(3)])
    dropped = read_prompt_file(f)
    assert [r["question"] for r in dropped.rows] == ["q0", "q1", "q2"] and "system" not in dropped.rows[0]
    assert dropped.notes == {SYSTEM_UNUSED: 3}
    kept = read_prompt_file(f, keep_system=True)
    assert kept.rows[0] == {"uid": "0", "question": "q0", "answer": "0", "system": "Think step by step."}
    few_shot = verl_row(0, "q", "1")
    few_shot["prompt"] = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                          {"role": "user", "content": "q"}]
    with pytest.raises(DatasetError, match=r"b.parquet row 1: column 'prompt' holds the turns \['user', 'assistant'"):
        read_prompt_file(write_parquet(tmp_path / "b.parquet", [few_shot]))


SYS = "You are a careful olympiad coach. Check every step twice."


def test_keep_system_takes_a_kept_system_turn_into_the_rendered_prompt(tmp_path):
    """stages[].keep_system, off: a verl prompt's system turn is dropped wherever a stage reads prompts (rl data,
    validation, an "@<stage>" subset, hard_subset, eval benchmarks) and the run's system prompt is rendered; on: the
    row's system turn is rendered in place of rStar2's preamble, the tool's schema still after it (what the exported
    model's chat template renders for that conversation), or in place of a custom system_prompt whole."""
    from rstar_hpc import pipeline
    from rstar_hpc.config.run import TinyModelSpec
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.models.tiny import build_tokenizer
    from rstar_hpc.rollout import validation
    from rstar_hpc.rollout.step import make_items

    f = write_parquet(tmp_path / "sys.parquet", [verl_row(i, f"Compute {i} + 1.", str(i + 1), system=SYS)
                                                 for i in range(2)])
    tok = build_tokenizer(TinyModelSpec())
    tok.chat_template = fmt.serving_chat_template(fmt.system_prompt())   # an exported model's (rstar-hpc export)
    expected = [tok.apply_chat_template([{"role": "system", "content": SYS},
                                         {"role": "user", "content": f"Compute {i} + 1."}],
                                        tools=[fmt.TOOL_SCHEMA], add_generation_prompt=True, tokenize=False)
                for i in range(2)]
    subset = RunPaths(tmp_path / "runs" / "tiny-cpu").stage_data("hard")   # as write_hard_subset writes it
    subset.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{"uid": "0", "question": "Compute 0 + 1.", "answer": "1", "system": SYS,
                                          "solved": 1, "samples": 4}]), subset)
    for keep in (False, True):
        cfg = load_config("tiny-cpu", [f"run.root={tmp_path / 'runs'}",
                                       *(f"stages.{s}.keep_system={keep}" for s in ("rl-short", "hard", "rl-hard",
                                                                                     "eval")),
                                       f"stages.rl-short.data={f}", "stages.rl-short.val_every=1",
                                       f"stages.rl-short.val_data={f}", f"stages.hard.data={f}",
                                       f"stages.eval.benchmarks={json.dumps({'aime': str(f)})}"])
        sets = {s: pipeline.stage_prompts(cfg, cfg.stage(s)) for s in ("rl-short", "hard", "rl-hard", "eval")}
        sets["validation"] = validation.val_prompts(cfg, cfg.stage("rl-short"))
        for name, prompts in sets.items():
            assert [p.get("system") for p in prompts] == [SYS if keep else None] * len(prompts), (name, keep)
            items, dropped = make_items(prompts, tok, agent=cfg.rollout.agent, samples_per_prompt=1)
            assert not dropped and len(items) == len(prompts) > 0
            for item, p in zip(items, prompts):
                i = int(p["question"].split()[1])
                assert item.prompt_ids == tok.encode(item.prompt_text, add_special_tokens=False)
                if keep:
                    assert item.prompt_text == expected[i] and fmt.SYSTEM_PREAMBLE not in item.prompt_text
                else:
                    assert SYS not in item.prompt_text and item.prompt_text == fmt.render_prompt(p["question"])
    custom = load_config("tiny-cpu", [f"stages.rl-short.data={f}", "stages.rl-short.keep_system=true",
                                      "rollout.agent.system_prompt=Answer briefly."])
    (item,), _ = make_items(pipeline.stage_prompts(custom, custom.stage("rl-short"))[:1], tok,
                            agent=custom.rollout.agent, samples_per_prompt=1)
    assert item.prompt_text == fmt.render_prompt("Compute 0 + 1.", system=SYS)   # the custom prompt replaced whole
    with pytest.raises(Exception, match="keep_system"):   # sft chats keep their system turns: no such knob
        load_config("tiny-cpu", ["stages.sft.keep_system=true"])


def test_dapo_repeats_are_dropped_and_counted(tmp_path):
    # the original DAPO-Math-17k: verl schema, each prompt repeated (here 5 times), every copy with its own index
    rows = [verl_row(100 * k + i, f"Problem {k}", str(k)) for i in range(5) for k in range(4)]
    got = read_prompt_file(write_parquet(tmp_path / "dapo.parquet", rows))
    assert (got.read, len(got.rows), got.dropped) == (20, 4, {REPEATS: 16})
    assert [r["question"] for r in got.rows] == [f"Problem {k}" for k in range(4)]
    # open-r1's processed copy: flat `prompt` (a string) and `solution` (the short answer) beside reward_model
    flat = [{"prompt": f"Problem {k}", "solution": str(k), "reward_model": {"ground_truth": str(k)}}
            for k in (1, 2, 1)]
    got = read_prompt_file(write_parquet(tmp_path / "flat.parquet", flat))
    assert [(r["question"], r["answer"]) for r in got.rows] == [("Problem 1", "1"), ("Problem 2", "2")]
    assert got.dropped == {REPEATS: 1} and got.format == "question-answer"


def test_gsm8k_answers_give_the_number_after_the_hashes(tmp_path):
    f = write_jsonl(tmp_path / "gsm8k.jsonl", [
        {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                     "How many clips did Natalia sell altogether in April and May?",
         "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                   "altogether in April and May.\n#### 72"},
        {"question": "How much?", "answer": "He pays 1000 + 234 = <<1000+234=1234>>1,234 dollars.\n#### 1,234"}])
    got = read_prompt_file(f)
    assert [r["answer"] for r in got.rows] == ["72", "1234"] and got.format == "gsm8k"


def test_math_solutions_give_their_last_boxed_answer(tmp_path):
    f = write_jsonl(tmp_path / "math.jsonl", [
        {"problem": "What is half of one?", "solution": "First $\\boxed{2}$ is wrong. We get $\\boxed{\\frac{1}{2}}$."},
        {"problem": "Area?", "solution": "The area is $\\fbox{\\sqrt{3}}$ square units, as the figure shows."}])
    got = read_prompt_file(f)
    assert [r["answer"] for r in got.rows] == ["\\frac{1}{2}", "\\sqrt{3}"] and got.format == "math-solution"


@pytest.mark.parametrize(("text", "expected"), [
    ("72", ("72", "as given")), ("\\frac{1}{2}", ("\\frac{1}{2}", "as given")),
    ("\\text{Devon and Evelyn are both right}", ("\\text{Devon and Evelyn are both right}", "as given")),
    ("(1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12)", ("(1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12)",
                                                         "as given")),
    ("\\boxed{\\{1, 2\\}}", ("\\{1, 2\\}", "last \\boxed{}")), ("so\n#### -3", ("-3", "#### n")),
    ("We first note that the sum of the two numbers is even, so the answer must be even as well.", None),
])
def test_the_ground_truth_rules(text, expected):
    assert ground_truth(text) == expected


@pytest.mark.parametrize(("rows", "column"), [
    ([{"question": "q", "answer": "2"},
      {"question": "r", "answer": "We add the two numbers and then divide the sum by two, which gives the mean of "
                                  "both."}], "answer"),
    ([{"problem": "p", "solution": "Let the side be s. Then the area is s squared, and since the perimeter is twelve "
                                   "we get three."}], "solution"),
])
def test_a_rationale_with_no_final_answer_is_refused_naming_the_column(tmp_path, rows, column):
    f = write_jsonl(tmp_path / "r.jsonl", rows)
    with pytest.raises(DatasetError, match=rf"r.jsonl row {len(rows)}: column '{column}' holds a worked solution"):
        read_prompt_file(f)


# -- OpenAI-style chat files (sft) ---------------------------------------------------------------------------------

def test_openai_tool_calls_are_rendered_in_the_rstar2_format(tmp_path):
    f = write_jsonl(tmp_path / "sft.jsonl", [openai_chat(), openai_chat(content="Let me compute it.")])
    a, b = load_chat_jsonl(f)
    call = fmt.render_tool_call("print(12 * 13)")
    assert a == [{"role": "system", "content": fmt.system_prompt([fmt.TOOL_SCHEMA])},
                 {"role": "user", "content": "Compute 12 * 13."},
                 {"role": "assistant", "content": call},
                 {"role": "tool", "content": "156"},
                 {"role": "assistant", "content": "<answer>\\boxed{156}</answer>"}]
    assert b[2]["content"] == "Let me compute it.\n" + call
    flat = openai_chat(content="")   # Parquet: one content type per column; arguments as an object
    flat["messages"][0]["content"] = "Compute 12 * 13."
    flat["messages"][1]["tool_calls"] = [dict(CALL, function={"name": fmt.TOOL_NAME,
                                                              "arguments": {"code": "print(12 * 13)", "input": ""}})]
    assert load_chat_jsonl(write_parquet(tmp_path / "sft.parquet", [flat]))[0] == a


@pytest.mark.parametrize(("chat", "match"), [
    (openai_chat(call=dict(CALL, function={"name": "f", "arguments": "{not json"})),
     r"sft.jsonl:1 message 2: tool call arguments are not JSON"),
    (openai_chat(call=dict(CALL, function={"arguments": "{}"})), "without a function name"),
    (openai_chat(tool_call_id="call_9"), r"message 3: tool_call_id 'call_9' names no call"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]},
     r"message 2: an assistant turn with no content and no tool_calls"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                   {"role": "assistant", "content": "y"}]}, "a content part of type 'image_url'"),
])
def test_a_malformed_chat_is_refused_naming_row_and_message(tmp_path, chat, match):
    with pytest.raises(DatasetError, match=match):
        load_chat_jsonl(write_jsonl(tmp_path / "sft.jsonl", [chat]))
