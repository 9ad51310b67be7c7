"""`rstar-hpc config show|validate|explain`."""
from __future__ import annotations

import click

from rstar_hpc.config import ConfigError, dump_config, load_config
from rstar_hpc.config.loader import DEFAULT_CONFIG


@click.group("config")
def command() -> None:
    """Show, validate and explain run configs.

    CONFIG is a path to a YAML file or a config name (tiny-cpu, qwen3-14b), looked up in ./configs/, then
    $RSTAR_HPC_CONFIGS (a site's folders), then the configs this install ships (`config show --list`). OVERRIDES
    are dotted key=value pairs, e.g. rollout.agent.max_turns=10. The public rStar recipe's
    augmentation.down_sampling_config.* keys are accepted as aliases of algo.roc.*.

    Start your own from a shipped one: `rstar-hpc config show qwen3-14b > mine.yaml`.
    """


@command.command("show")
@click.argument("config", default=DEFAULT_CONFIG)
@click.argument("overrides", nargs=-1)
@click.option("--list", "list_", is_flag=True, help="List the config names that resolve, each with its file and "
                                                    "where it came from (./configs, $RSTAR_HPC_CONFIGS, packaged).")
def show(config: str, overrides: tuple[str, ...], list_: bool) -> None:
    """Print the resolved config (defaults filled in, overrides applied) as YAML."""
    if list_:
        from rstar_hpc import assets

        found = assets.known_configs()
        width = max((len(name) for name, _, _ in found), default=0)
        for name, path, src in found:
            click.echo(f"{name:<{width}}  {src.label:<18}  {path}")
        searched = ", ".join(f"{s.label}={s.dir}" for s in assets.config_sources())
        click.echo(f"# searched in order: {searched}", err=True)
        return
    click.echo(dump_config(load_config(config, overrides)), nl=False)


@command.command("validate")
@click.argument("config", default=DEFAULT_CONFIG)
@click.argument("overrides", nargs=-1)
@click.option("--no-data", is_flag=True, help="Check the config alone, not the data files it names (e.g. where they "
                                              "are not: off the cluster).")
def validate(config: str, overrides: tuple[str, ...], no_data: bool) -> None:
    """Check a config and every data file it names (stages[].data, eval benchmarks; as `rstar-hpc data check` does);
    exit 0 if all is usable, 3 with the offending keys or files named if not. A file not on this machine is only
    named (a recipe's placeholder path, or data on a file system this node does not mount): `launch` refuses it."""
    cfg = load_config(config, overrides)
    try:
        cfg.tracking.check_installed()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    stages = " -> ".join(f"{s.name}({s.kind})" for s in cfg.stages) or "no stages"
    if not no_data:
        _check_data(cfg, config)
    click.echo(f"ok: {config}: run {cfg.run.name!r}, {stages}")


def _check_data(cfg, config: str) -> None:
    """Read every data file of `cfg` with the stages' readers; DatasetError (exit 3) listing every problem."""
    from rstar_hpc.cli.data import describe, summary_line
    from rstar_hpc.data.files import DataFileMissing
    from rstar_hpc.data.sets import DatasetError, config_data_files

    done: dict[tuple[str, str], str | DatasetError] = {}
    problems = []
    for where, kind, data in config_data_files(cfg):
        if (kind, data) not in done:
            try:
                done[kind, data] = summary_line(describe(data, kind, 0))
            except DatasetError as e:
                done[kind, data] = e
        got = done[kind, data]
        if isinstance(got, DataFileMissing):
            click.echo(f"data: {where}: {data}: not on this machine, not checked (launch checks it again)", err=True)
        elif isinstance(got, DatasetError):
            problems.append(f"{where}: {got}")
        else:
            click.echo(f"data: {where}: {data}: {got}")
    if problems:
        raise DatasetError(f"{config}: {len(problems)} data file(s) cannot be used (`--no-data` checks the config "
                           f"alone):\n  " + "\n  ".join(problems))


@command.command("explain")
@click.argument("section", default="")
def explain(section: str) -> None:
    """Describe every key under SECTION (e.g. `algo.roc`), with type, default and meaning."""
    from rstar_hpc.config.explain import explain_section

    click.echo(explain_section(section))
