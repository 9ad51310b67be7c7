"""`rstar-hpc launch`: a whole run (every stage of a config) as one submission."""
from __future__ import annotations

import json
import sys

import click

from rstar_hpc.cli.exit_codes import EXIT_CONFIG, EXIT_FAILED, EXIT_REFUSED


@click.command("launch")
@click.argument("config")
@click.argument("overrides", nargs=-1)
@click.option("--launcher", type=click.Choice(["sbatch", "submitit"]), default=None,
              help="sbatch: one heterogeneous job; submitit: one job per role [launch.launcher of the config].")
@click.option("--wait", is_flag=True, help="Follow the run (a progress line per change) until it is done.")
@click.option("--dry-run", is_flag=True, help="Print the job script (sbatch) or job parameters (submitit); submit "
              "nothing.")
@click.option("--timeout-s", type=float, default=None, help="With --wait: give up following after this long.")
@click.option("--json", "as_json", is_flag=True, help="End with one JSON line: run, jobs, placement (one entry per "
              "task), and (with --wait) status; with --dry-run also the script or parameters and each role's srun "
              "line.")
def command(config: str, overrides: tuple[str, ...], launcher, wait: bool, dry_run: bool, timeout_s, as_json) -> None:
    """Submit every stage of CONFIG (sft -> rl ... -> hard_subset -> rl -> eval) as one run.

    CONFIG is a config name (`rstar-hpc config show --list`), a YAML path, or a run directory's config.yaml
    (launching a run again continues it where its run directory says it stopped). OVERRIDES are dotted key=value
    pairs, e.g. model.path=/lustre/models/Qwen3-14B-Base launch.trainer.partition=a100 launch.account=proj42.
    Site settings (partition, account, qos, constraint, time, gres, modules) come from the config's `launch`
    section and overrides; `--dry-run` shows the result.
    """
    from rstar_hpc.config import load_config
    from rstar_hpc.launch.launcher import LaunchError, launch_run
    from rstar_hpc.launch.placement import PlacementError, Task, table

    cfg = load_config(config, list(overrides))
    try:
        info = launch_run(cfg, launcher, wait=wait, dry_run=dry_run, timeout_s=timeout_s,
                          echo=lambda line: click.echo(line, err=as_json))
    except PlacementError as e:
        click.echo(f"rstar-hpc launch: {e}\n  nothing was submitted; `rstar-hpc config explain launch` lists the "
                   f"keys", err=True)
        sys.exit(EXIT_CONFIG)
    except LaunchError as e:
        click.echo(f"rstar-hpc launch: {e}", err=True)
        sys.exit(EXIT_FAILED)
    if dry_run:
        for line in info.get("warnings", []):
            click.echo(line, err=True)
        if as_json:
            click.echo(json.dumps(info))
            return
        if info["launcher"] == "sbatch":
            click.echo(info["script"], nl=False)
        else:
            click.echo(json.dumps(info["parameters"], indent=1))
        tasks = [Task(**{**t, "gpus": tuple(t["gpus"]), "devices": tuple(t["devices"])}) for t in info["placement"]]
        click.echo("\n# placement (node numbers within each role's nodes):\n"
                   + "\n".join("# " + line for line in table(tasks).splitlines()))
        return
    status = info.get("status")
    if not as_json:
        click.echo(f"follow it: rstar-hpc run status {info['dir']} --watch   logs: rstar-hpc run logs {info['dir']} -f")
    else:
        click.echo(json.dumps(info, default=str))
    if status is not None and not status["done"]:
        click.echo("the run stopped before every stage was done:\n  " + "\n  ".join(status["problems"] or
                   ["see `rstar-hpc run status`"]), err=True)
        sys.exit(EXIT_REFUSED if status.get("refused") else EXIT_FAILED)
