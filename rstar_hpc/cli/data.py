"""`rstar-hpc data show|check FILE`: how the project reads a data file, with the code the stages use
(rstar_hpc.data.sets.read_data)."""
from __future__ import annotations

import json

import click

KIND = click.option("--kind", type=click.Choice(["rl", "eval", "sft"]), default=None,
                    help="How the file is used: prompts with answers (rl, eval) or chats (sft). Default: guessed from "
                         "the columns (a 'messages' column and no question column: sft).")


@click.group("data")
def command() -> None:
    """Show how a data file is read (layout, rows, what was dropped and why, the first rows normalised), or check
    it for scripts (exit 0, or 3 with the reason).

    FILE is a JSONL or Parquet file, or a demo set name (demo, demo-eval, demo-N). Prompt files may be in the verl
    schema (microsoft/rStar's data_preprocess, DAPO-Math-17k), question/problem + answer columns, GSM8K
    (`#### n`) or MATH solutions (the last \\boxed{}); chat files are OpenAI-style `messages` (tool_calls too).
    """


def _read(file: str, kind: str | None, keep_system: bool = False):
    from rstar_hpc.data.sets import ChatSet, read_data

    got = read_data(file, kind, keep_system=keep_system)
    return got, ("sft" if isinstance(got, ChatSet) else kind or "rl")


def describe(file: str, kind: str | None, n: int = 3, keep_system: bool = False) -> dict:
    """{"file", "kind", "format", "rows", "read", "dropped", "sources", "notes", "sample"} of FILE."""
    got, kind = _read(file, kind, keep_system)
    if kind == "sft":
        from rstar_hpc.data.chats import render_text

        sample = [{"text": render_text(c)} for c in got.rows[:n]]
        sources = {}
    else:
        sample = [{k: p[k] for k in ("uid", "system", "question", "answer") if k in p} for p in got.rows[:n]]
        sources = got.sources
    return {"file": file, "kind": kind, "format": got.format, "rows": len(got.rows), "read": got.read,
            "dropped": got.dropped, "sources": sources, "notes": got.notes, "sample": sample}


def summary_line(d: dict) -> str:
    dropped = sum(d["dropped"].values())
    why = f", {dropped} dropped ({'; '.join(f'{k}: {v}' for k, v in d['dropped'].items())})" if dropped else ""
    return f"{d['kind']}, format {d['format']}, {d['rows']} rows{why}"


def _indent(text: str, pad: str = "      ") -> str:
    return "\n".join(pad + line for line in text.splitlines()) or pad


def _print(d: dict) -> None:
    click.echo(f"file:    {d['file']}")
    click.echo(f"kind:    {d['kind']}")
    click.echo(f"format:  {d['format']}")
    click.echo(f"rows:    {d['rows']} (of {d['read']} read)")
    click.echo("dropped: " + ("; ".join(f"{v} {k}" for k, v in d["dropped"].items()) or "none"))
    for what, counts in (("read as", d["sources"]), ("notes", d["notes"])):
        for k, v in counts.items():
            click.echo(f"{what + ':':<8} {v} rows: {k}" if what == "read as" else f"{what + ':':<8} {k}: {v}")
    for i, s in enumerate(d["sample"], 1):
        click.echo(f"\n[{i}]" + (f" uid {s['uid']}" if "uid" in s else ""))
        for key in ("system", "question", "answer", "text"):
            if key in s:
                click.echo(f"  {key}:\n{_indent(s[key])}")


@command.command("show")
@click.argument("file")
@KIND
@click.option("-n", "--rows", "n", default=3, show_default=True, help="How many normalised rows to show.")
@click.option("--keep-system", is_flag=True, help="Keep a verl prompt's system turn (shown as 'system').")
@click.option("--json", "as_json", is_flag=True,
              help='The last stdout line is one JSON object: {"format", "rows", "dropped", "sample", ...}.')
def show(file: str, kind: str | None, n: int, keep_system: bool, as_json: bool) -> None:
    """Show how FILE is read: the detected layout, the row count, what was dropped and why, the first rows
    normalised (question and ground truth; for sft the rendered conversation). Exit 3 if it cannot be used."""
    d = describe(file, kind, n, keep_system)
    if as_json:
        click.echo(json.dumps(d))
    else:
        _print(d)


@command.command("check")
@click.argument("file")
@KIND
def check(file: str, kind: str | None) -> None:
    """Exit 0 if FILE can be used as it is, 3 with the reason (file, row, fix) on stderr if not."""
    click.echo(f"ok: {file}: {summary_line(describe(file, kind, 0))}")
