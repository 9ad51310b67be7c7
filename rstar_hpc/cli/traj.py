"""`rstar-hpc traj ls|show|export`: look at a run's trajectory shards (committed data only)."""
from __future__ import annotations

import click

from rstar_hpc.cli.exit_codes import NotFound, run_paths as _paths


def _stage(paths, stage: str | None) -> str:
    stages = paths.traj_stages()
    if stage is None:
        if len(stages) == 1:
            return stages[0]
        raise click.UsageError(f"{paths.dir} has trajectories of stages {stages or 'none'}; pick one with --stage")
    if stage not in stages:
        raise NotFound(f"no trajectories of stage {stage!r} in {paths.dir}; stages with trajectories: {stages}")
    return stage


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


@click.group("traj")
def command() -> None:
    """List, show and export trajectory shards of a run.

    RUN is a run directory, or a run name under $RSTAR_HPC_RUN_ROOT. Only committed steps are read.
    """


@command.command("ls")
@click.argument("run")
@click.option("--stage", default=None, help="Only this stage (default: all).")
def ls(run: str, stage: str | None) -> None:
    """Steps, producers, shards, rows and sizes, from the commit records (no shard is opened)."""
    from rich.console import Console
    from rich.table import Table

    from rstar_hpc.exchange.reader import StepReader

    paths = _paths(run)
    stages = [_stage(paths, stage)] if stage else paths.traj_stages()
    table = Table("stage", "step", "producers", "shards", "rows", "size", "uncommitted files", title=str(paths.dir))
    total_rows = total_bytes = 0
    for st in stages:
        reader = StepReader(paths, st)
        for step in paths.traj_steps(st):
            records = reader.commits(step)
            shards = [s for r in records.values() for s in r["shards"]]
            listed = {s["file"] for s in shards}
            leftovers = [n.name for n in paths.traj_step_dir(st, step).iterdir()
                         if n.suffix == ".arrows" and n.name not in listed or n.name.startswith(".")]
            rows, size = sum(s["rows"] for s in shards), sum(s["bytes"] for s in shards)
            total_rows, total_bytes = total_rows + rows, total_bytes + size
            table.add_row(st, str(step), ",".join(sorted(records)) or "-", str(len(shards)), str(rows),
                          _size(size), str(len(leftovers)) if leftovers else "")
    if not table.row_count:
        click.echo(f"{paths.dir}: no trajectory steps yet")
        return
    console = Console(width=140)
    console.print(table)
    console.print(f"total: {total_rows} rows, {_size(total_bytes)} committed")


@command.command("show")
@click.argument("run")
@click.option("--step", type=int, required=True, help="Training step.")
@click.option("--stage", default=None, help="Stage (needed when the run has several).")
@click.option("--uid", default=None, help="Prompt uid: show its samples (default: the step's first trajectory).")
@click.option("--sample", "sample_index", type=int, default=None, help="Only this sample index of --uid.")
@click.option("--limit", type=int, default=4, show_default=True, help="At most this many trajectories.")
def show(run: str, step: int, stage: str | None, uid: str | None, sample_index: int | None, limit: int) -> None:
    """A readable conversation: reasoning, tool calls and results, answer, reward, RoC penalties and decision."""
    from rich.console import Console

    from rstar_hpc.exchange.columns import from_table
    from rstar_hpc.exchange.reader import StepReader

    paths = _paths(run)
    stage = _stage(paths, stage)
    reader = StepReader(paths, stage)
    if not reader.commits(step):
        raise NotFound(f"step {step} of stage {stage!r} has no committed trajectories; `rstar-hpc traj ls {run}` "
                       f"lists the steps")
    table = reader.read(step)
    trajs, decisions = from_table(table), _roc_decisions(paths, stage, step, table)
    if uid is not None:
        trajs = [t for t in trajs if t.prompt_uid == uid]
        if not trajs:
            raise NotFound(f"no prompt uid {uid!r} in step {step}")
    if sample_index is not None:
        trajs = [t for t in trajs if t.sample_index == sample_index]
    console = Console(width=120)
    for t in trajs[:limit]:
        render_trajectory(console, t, decisions.get(t.key, decisions.get(None)))
    if len(trajs) > limit:
        console.print(f"... {len(trajs) - limit} more; raise --limit or pick --uid/--sample")


@command.command("export")
@click.argument("run")
@click.option("--to", "fmt", type=click.Choice(["parquet", "jsonl"]), required=True)
@click.option("--stage", default=None, help="Stage (needed when the run has several).")
@click.option("--step", type=int, default=None, help="One step (default: every committed step).")
@click.option("--out", type=click.Path(), default=None, help="Output directory (default: <run>/export/<stage>).")
def export(run: str, fmt: str, stage: str | None, step: int | None, out: str | None) -> None:
    """Copy committed steps to Parquet (analytics, DuckDB) or JSON Lines (one trajectory per line)."""
    from pathlib import Path

    from rstar_hpc.exchange.export import export_table
    from rstar_hpc.exchange.reader import StepReader

    paths = _paths(run)
    stage = _stage(paths, stage)
    reader = StepReader(paths, stage)
    steps = [step] if step is not None else [s for s in paths.traj_steps(stage) if reader.commits(s)]
    if not steps or not reader.commits(steps[0]):
        raise NotFound(f"no committed trajectories to export for stage {stage!r} step {step}")
    for s in steps:
        target = paths.export_file(stage, s, fmt)
        target = Path(out) / target.name if out else target
        rows = export_table(reader.read(s), target, fmt)
        click.echo(f"{target}: {rows} rows")


def _roc_decisions(paths, stage: str, step: int, table) -> dict:
    """key -> the trainer's RoC decision ("kept_positive", ...), rerun from the step's rows with the run's config
    (the selection is a function of them and the seed); else a default entry (None) that says why there is none."""
    from rstar_hpc.algo.roc import select_step
    from rstar_hpc.config import load_config
    from rstar_hpc.exchange.columns import TrajectoryColumns

    try:
        cfg = load_config(str(paths.config))
        if cfg.stage(stage).kind != "rl":
            return {None: f"none ({stage} is a {cfg.stage(stage).kind} stage: nothing is trained)"}
    except (KeyError, ValueError, OSError) as e:
        return {None: f"unknown (the run's config.yaml does not give it: {str(e).splitlines()[0][:100]})"}
    cols = TrajectoryColumns(table)
    reasons = select_step(table, cfg.algo.roc, run_seed=cfg.run.seed, step=step).reason_names()
    return dict(zip(zip(cols.prompt_uid, cols.sample_index.tolist()), reasons))


def render_trajectory(console, t, decision: str | None = None) -> None:
    """One trajectory as a conversation; tool results sit under the call that produced them."""
    import json

    import numpy as np
    from rich.markup import escape
    from rich.panel import Panel
    from rich.rule import Rule

    mask = np.asarray(t.loss_mask)
    console.print(Rule(f"[bold]{t.stage} step {t.step}[/] · {escape(t.prompt_uid)} #{t.sample_index} · "
                       f"policy v{t.policy_version} · engine {t.engine_rank} · finish {t.finish_reason}"))
    if t.prompt_text:
        console.print(Panel(escape(t.prompt_text), title="prompt", style="dim", title_align="left"))
    calls_by_turn: dict[int, list] = {}
    for c in t.tool_calls:
        calls_by_turn.setdefault(c.turn, []).append(c)
    for i, turn in enumerate(t.turns):
        if turn.role == "tool":
            continue   # shown as the result of the call that caused it
        console.print(Panel(escape(turn.text) or f"({turn.end - turn.start} tokens, no text stored)",
                            title=f"assistant · turn {i} · {turn.end - turn.start} tokens", title_align="left"))
        for c in calls_by_turn.get(i, []):
            style = "green" if c.status == "ok" else "yellow" if not c.is_error else "red"
            try:
                args = json.loads(c.arguments)
                code = args.get("code", c.arguments) if isinstance(args, dict) else c.arguments
            except json.JSONDecodeError:
                code = c.arguments
            cut = f" · cut from {c.output_chars} chars" if c.output_chars > len(c.output) else ""
            console.print(Panel(f"[bold]{escape(c.name or '(unparsed call)')}[/]\n{escape(code)}\n"
                                f"[{style}]── result: {c.status} · {c.wall_time_s:.2f}s{cut}[/]\n{escape(c.output)}",
                                title="tool call", border_style=style, title_align="left"))
    errors = sum(c.is_error for c in t.tool_calls)
    console.print(f"[bold]answer[/]: {escape(str(t.answer)) if t.answer is not None else '(none)'}   "
                  f"[bold]reward[/]: {t.reward:g}")
    console.print(f"RoC: p_err {t.p_err:.3f} ({errors}/{len(t.tool_calls)} calls failed) · p_format {t.p_format:.3f}"
                  f" · p_total {t.p_err + t.p_format:.3f} · decision [bold]{escape(decision or '-')}[/]")
    tm = t.timings
    console.print(f"tokens: prompt {len(t.prompt_ids)}, response {mask.size} (model {int(mask.sum())}, "
                  f"tool/template {int(mask.size - mask.sum())}) · time: generate {tm.generate_s:.2f}s, "
                  f"tools {tm.tool_s:.2f}s, reward {tm.reward_s:.2f}s, total {tm.total_s:.2f}s")
