"""`rstar-hpc report RUN`: the run's report (report.md, report.html, PNG plots), from its run directory alone."""
from __future__ import annotations

import json

import click

from rstar_hpc.cli.exit_codes import run_paths as _paths


def _compared(specs: tuple[str, ...]) -> list:
    out = []
    for spec in specs:
        label, sep, run = spec.partition("=")
        if not sep or not label or not run:
            raise click.BadParameter(f"{spec!r}: write LABEL=RUN, e.g. GRPO=runs/demo-grpo", param_hint="--compare")
        out.append((label, _paths(run)))
    return out


@click.command("report")
@click.argument("run")
@click.option("--compare", "compare", multiple=True, metavar="LABEL=RUN",
              help="Overlay another run on every plot and table (repeatable), e.g. GRPO=runs/demo-grpo.")
@click.option("--label", default=None, help="This run's name in legends and tables (default: its directory name).")
@click.option("--out", "out", type=click.Path(file_okay=False), default=None,
              help="Folder for report.md, report.html and the PNGs (default: RUN/report/).")
@click.option("--json", "as_json", is_flag=True, help="Print the headline figures as one JSON object (last line).")
def command(run: str, compare: tuple[str, ...], label: str | None, out: str | None, as_json: bool) -> None:
    """Render a run's report: report.md and report.html with PNG plots per RL step (mean reward, pass@1 at eval
    points, tool-error ratio of kept positives, response length, tool calls per trajectory, step time
    breakdown) and a pass@1 table of the base, SFT and RL models with standard errors.

    RUN is a run directory or a run name under $RSTAR_HPC_RUN_ROOT. What a run has not recorded is skipped with
    a note. The same metrics are in TensorBoard: tensorboard --logdir RUN/tb
    """
    from pathlib import Path

    from rstar_hpc.report.build import NothingToReport, build_report

    paths = _paths(run)
    try:
        report = build_report(paths, label=label, compare=_compared(compare), out=Path(out) if out else None)
    except NothingToReport as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"report: {report.markdown}\n        {report.html}\n        {len(report.plots)} plot(s) in "
               f"{report.out}")
    for note in report.notes:
        click.echo(f"  not shown: {note}")
    if as_json:
        click.echo(json.dumps(report.headline))
