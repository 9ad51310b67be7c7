"""`rstar-hpc trainer plan`: the former name of `rstar-hpc train --plan`, kept for one release."""
from __future__ import annotations

import click

from rstar_hpc.config.loader import DEFAULT_CONFIG


@click.group("trainer")
def command() -> None:
    """Deprecated: `rstar-hpc train --plan` prints the trainer's plan (this group goes in the next release)."""


@command.command("plan")
@click.argument("config", default=DEFAULT_CONFIG)
@click.argument("overrides", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object.")
@click.option("--gpu-memory-gib", type=float, default=80.0, show_default=True,
              help="GPU memory to check the estimate against.")
def plan(config: str, overrides: tuple[str, ...], as_json: bool, gpu_memory_gib: float) -> None:
    """Deprecated name of `rstar-hpc train CONFIG --plan`."""
    from rstar_hpc.cli.train import print_memory_plan

    click.echo("note: `rstar-hpc trainer plan` is now `rstar-hpc train CONFIG --plan`; this name goes in the next "
               "release", err=True)
    print_memory_plan(config, overrides, as_json, gpu_memory_gib)
