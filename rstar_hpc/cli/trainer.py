"""`rstar-hpc trainer plan CONFIG [overrides]`: a trainer layout's per-GPU memory and micro-batch plan."""
from __future__ import annotations

import json
import sys

import click

from rstar_hpc.config.loader import DEFAULT_CONFIG


@click.group("trainer")
def command() -> None:
    """Trainer tools that need no GPU (the trainer itself runs with `rstar-hpc train`)."""


@command.command("plan")
@click.argument("config", default=DEFAULT_CONFIG)
@click.argument("overrides", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object.")
@click.option("--gpu-memory-gib", type=float, default=80.0, show_default=True,
              help="GPU memory to check the estimate against.")
def plan(config: str, overrides: tuple[str, ...], as_json: bool, gpu_memory_gib: float) -> None:
    """Per-rank memory (weights, grads, optimizer state, activations) and the micro-batch plan of each stage.

    Arithmetic from the config (trainer.*, launch.trainer, the model's config.json or published shape); see
    rstar_hpc/trainer/plan.py for the formulas. Exit 1 if the estimate exceeds --gpu-memory-gib.
    """
    from rstar_hpc.config import load_config
    from rstar_hpc.trainer.plan import format_plan, make_plan

    try:
        result = make_plan(load_config(config, overrides), gpu_memory_gib)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(result.to_dict()) if as_json else format_plan(result))
    if result.total_gib > gpu_memory_gib:
        sys.exit(1)
