"""`rstar-hpc config show|validate|explain`."""
from __future__ import annotations

import click

from rstar_hpc.config import dump_config, load_config
from rstar_hpc.config.loader import DEFAULT_CONFIG


@click.group("config")
def command() -> None:
    """Show, validate and explain run configs.

    CONFIG is a name in configs/ (tiny-cpu, qwen3-14b) or a path to a YAML file; OVERRIDES are dotted
    key=value pairs, e.g. rollout.agent.max_turns=10. The public rStar recipe's
    augmentation.down_sampling_config.* keys are accepted as aliases of algo.roc.*.
    """


@command.command("show")
@click.argument("config", default=DEFAULT_CONFIG)
@click.argument("overrides", nargs=-1)
def show(config: str, overrides: tuple[str, ...]) -> None:
    """Print the resolved config (defaults filled in, overrides applied) as YAML."""
    click.echo(dump_config(load_config(config, overrides)), nl=False)


@command.command("validate")
@click.argument("config", default=DEFAULT_CONFIG)
@click.argument("overrides", nargs=-1)
def validate(config: str, overrides: tuple[str, ...]) -> None:
    """Check a config; exit 0 if valid, 3 with the offending keys named if not."""
    cfg = load_config(config, overrides)
    stages = " -> ".join(f"{s.name}({s.kind})" for s in cfg.stages) or "no stages"
    click.echo(f"ok: {config}: run {cfg.run.name!r}, {stages}")


@command.command("explain")
@click.argument("section", default="")
def explain(section: str) -> None:
    """Describe every key under SECTION (e.g. `algo.roc`), with type, default and meaning."""
    from rstar_hpc.config.explain import explain_section

    click.echo(explain_section(section))
