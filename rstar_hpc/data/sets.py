"""What a stage trains or evaluates on: `stages[].data`, read in one place for every role.

    data: demo                   the built-in synthetic set (the CPU demo, rstar_hpc.data.demo_task: arithmetic in four
                                 levels with a distractor; easy ones can be done in the head, hard ones need the tool)
    data: demo-eval              the demo's held-out eval problems (DEMO_EVAL_PROMPTS, levels in equal shares)
    data: demo-256               the first 256 prompts of the demo set (e.g. a hard_subset stage's source)
    data: demo-noisy             the demo set; in an sft stage, the noisy variant's traces (a typo'd call then a
                                 retry in more than half of them: configs/demo-noisy.yaml)
    data: /lustre/rl-42k.parquet prompts with ground truth (rl, hard_subset, eval), JSONL or Parquet
    data: /lustre/sft.jsonl      chat samples (sft), JSONL or Parquet, {"messages": [...], "tools": [...]} per row

Files are read as users have them (rstar_hpc.data): prompt files in the verl schema (microsoft/rStar's
data_preprocess, DAPO-Math-17k: repeats dropped), question/problem + answer columns, GSM8K (`#### n`) and MATH
solutions (the last \\boxed{}), a rationale with no final answer refused; chat files in the OpenAI form (tool_calls
rendered in the rStar2 format). `uid` or `id` names a prompt, else `extra_info.index`, else a hash of its question.
A bad row is an error that names the file, the row and what is missing, before any engine starts.
`read_data` is what `rstar-hpc data show|check` and `config validate` call: the same readers the stages use.
"""
from __future__ import annotations

from pathlib import Path

from rstar_hpc.config.stages import StageConfig
from rstar_hpc.data.chats import CHAT_ROLES, ChatSet, read_chat_file
from rstar_hpc.data.files import DataFileMissing, DatasetError, read_rows
from rstar_hpc.data.prompts import ANSWER_KEYS, QUESTION_KEYS, PromptSet, read_prompt_file

DEMO = "demo"
DEMO_NOISY = "demo-noisy"
DEMO_PROMPTS = 4096   # the demo RL set: enough distinct prompts that a tiny run never repeats one within a stage
DEMO_EVAL_PROMPTS = 128   # 32 per level: pass@1's standard error ~0.03, small enough to see RL's gain on 2 cores
DEMO_SFT_SAMPLES = 20000   # > samples an SFT stage sees: fresh problems, nothing to memorise
KINDS = ("rl", "eval", "sft")
PROMPT_HINT = (f"set stages[].data to a JSONL or Parquet file, or to '{DEMO}' for the built-in demo set")
SFT_HINT = ("set stages[].data to a chat JSONL or Parquet file, or generate the demo set with "
            "`python -m rstar_hpc.synthetic.sft_chats FILE`")
__all__ = ["ANSWER_KEYS", "CHAT_ROLES", "QUESTION_KEYS", "ChatSet", "DataFileMissing", "DatasetError", "PromptSet"]


def demo_prompts(n: int, seed: int, *, held_out: bool = False) -> list[dict]:
    """n demo problems [{"uid", "question", "answer"}] (rstar_hpc.data.demo_task), levels in turn."""
    from rstar_hpc.data.demo_task import problems
    return problems(n, seed, held_out=held_out)


def is_demo(data: str | None) -> bool:
    return data is not None and (data == DEMO or data.startswith(DEMO + "-"))


def _demo_set(data: str, seed: int) -> list[dict]:
    rest = data[len(DEMO) + 1:] if data != DEMO else ""
    if not rest or data == DEMO_NOISY:   # the noisy variant differs in its SFT traces only
        return demo_prompts(DEMO_PROMPTS, seed)
    if rest == "eval":
        return demo_prompts(DEMO_EVAL_PROMPTS, seed, held_out=True)
    if rest.isdigit() and 0 < int(rest) <= DEMO_PROMPTS:
        return demo_prompts(int(rest), seed)
    raise DatasetError(f"{data!r}: not a demo set; use '{DEMO}', '{DEMO}-eval' or '{DEMO}-N' (the first N <= "
                       f"{DEMO_PROMPTS} demo prompts), or '{DEMO_NOISY}'")


def load_prompts(stage_cfg: StageConfig, seed: int = 0, run_dir=None) -> list[dict]:
    """The prompts of an rl or hard_subset stage as [{"uid", "question", "answer"}] (+ "system" where the stage's
    `keep_system` keeps a prompt's system turn), in file order; `run_dir` resolves `data: "@<stage>"` (the subset an
    earlier hard_subset stage wrote there)."""
    if stage_cfg.data is None:
        raise DatasetError(f"stage {stage_cfg.name!r} ({stage_cfg.kind}) has no data; set stages[].data to a JSONL or "
                           f"Parquet file of prompts with answers, or to '{DEMO}' for the built-in demo set")
    data = stage_cfg.data
    if data.startswith("@"):
        from rstar_hpc.exchange.rundir import RunPaths
        if run_dir is None:
            raise DatasetError(f"stage {stage_cfg.name!r}: data {data!r} is an earlier stage's output; it needs the "
                               f"run directory")
        path = RunPaths(run_dir).stage_data(data[1:])
        if not path.is_file():
            raise DatasetError(f"stage {stage_cfg.name!r}: {path} does not exist yet; stage {data[1:]!r} (hard_subset) "
                               f"writes it, and must be done before this stage starts")
        data = str(path)
    return load_prompt_file(data, seed, keep_system=stage_cfg.keep_system)


def load_prompt_file(data: str, seed: int = 0, *, keep_system: bool = False) -> list[dict]:
    """Prompts with answers from a JSONL or Parquet file, or the demo set ('demo'); a prompt's system turn is kept
    (as "system") only with `keep_system` (stages[].keep_system)."""
    if is_demo(data):
        return _demo_set(data, seed)
    return read_prompt_file(data, keep_system=keep_system, missing_hint=PROMPT_HINT).rows


def load_sft_conversations(stage_cfg: StageConfig, seed: int = 0, system_prompt: str | None = None) -> list[list[dict]]:
    """The chat samples of an sft stage (lists of {"role", "content"} messages). The built-in demo traces carry
    `system_prompt` (rollout.agent.system_prompt; None: rStar2's), so they match what the rollouts show."""
    if stage_cfg.data is None:
        raise DatasetError(f"stage {stage_cfg.name!r} (sft) has no data; set stages[].data to a chat JSONL file "
                           f"({{\"messages\": [...]}} per line), or to '{DEMO}' for the built-in demo set")
    if stage_cfg.data in (DEMO, DEMO_NOISY):
        from rstar_hpc.data.demo_task import sft_samples
        chats = sft_samples(DEMO_SFT_SAMPLES, seed, system=system_prompt, noisy=stage_cfg.data == DEMO_NOISY)
        return [s["messages"] for s in chats]
    return load_chat_jsonl(stage_cfg.data)


def load_chat_jsonl(path: str | Path) -> list[list[dict]]:
    """The conversations of a chat file (JSONL or Parquet; rstar_hpc.data.chats): rStar2 messages."""
    return read_chat_file(path, SFT_HINT).rows


def guess_kind(columns) -> str:
    """'sft' for a file of chats (a `messages` column and no question column), else 'rl'."""
    columns = set(columns)
    return "sft" if "messages" in columns and not columns & {*QUESTION_KEYS} else "rl"


def read_data(data: str, kind: str | None = None, seed: int = 0, *, keep_system: bool = False) -> PromptSet | ChatSet:
    """A stage's data as the stages read it, with how it was read: the demo sets by name, files by their layout.
    `kind` rl or eval (prompts), sft (chats); None guesses it from the columns."""
    if kind not in (None, *KINDS):
        raise DatasetError(f"kind {kind!r}: one of {', '.join(KINDS)}")
    if data.startswith("@"):
        raise DatasetError(f"{data!r} is the subset an earlier hard_subset stage writes into the run directory; "
                           f"name that file (RUN/data/<stage>.parquet) to read it")
    if is_demo(data):
        if kind == "sft":
            from rstar_hpc.data.demo_task import sft_samples
            chats = [s["messages"] for s in sft_samples(DEMO_SFT_SAMPLES, seed, noisy=data == DEMO_NOISY)]
            return ChatSet(chats, data, len(chats))
        rows = _demo_set(data, seed)
        return PromptSet(rows, "demo", len(rows), sources={"the built-in demo set (rstar_hpc.data.demo_task)": len(rows)})
    src = read_rows(data, SFT_HINT if kind == "sft" else PROMPT_HINT)
    if (kind or guess_kind(src.columns())) == "sft":
        return read_chat_file(src)
    return read_prompt_file(src, keep_system=keep_system)


def config_data_files(cfg) -> list[tuple[str, str, str]]:
    """(where the config names it, kind, file) of every data file of `cfg`'s stages: stages[].data and eval
    benchmarks; the demo sets and "@<stage>" outputs (not there before the run) are left out."""
    out = []
    for s in cfg.stages:
        named = ({f"stages.{s.name}.benchmarks.{k}": v for k, v in s.benchmarks.items()} if s.kind == "eval" and
                 s.benchmarks else {f"stages.{s.name}.data": s.data})
        kind = {"sft": "sft", "eval": "eval"}.get(s.kind, "rl")
        if s.kind == "rl":   # held-out validation problems are read like eval benchmarks
            named.update({f"stages.{s.name}.val_data" + (f".{k}" if isinstance(s.val_data, dict) else ""): v
                          for k, v in s.val_files().items()})
        out += [(where, "eval" if ".val_data" in where else kind, data) for where, data in named.items()
                if data and not is_demo(data) and not data.startswith("@")]
    return out
