"""`rstar-hpc run status`: what a run directory says about the run (no Slurm query, no shard opened)."""
from __future__ import annotations

import time

import click

from rstar_hpc.cli.traj import _paths


@click.group("run")
def command() -> None:
    """Inspect a run directory: stage state, checkpoints, trajectories and role announcements.

    RUN is a run directory, or a run name under $RSTAR_HPC_RUN_ROOT.
    """


@command.command("status")
@click.argument("run")
@click.option("--stale-after", "stale_after_s", type=float, default=120.0, show_default=True,
              help="Mark announcements not refreshed for this many seconds as stale.")
def status(run: str, stale_after_s: float) -> None:
    """Stage states (status, step, data cursor, policy version), latest checkpoint per stage, and what each
    role last announced (host:port, pid, Slurm job, age)."""
    from rich.console import Console
    from rich.table import Table

    from rstar_hpc.exchange import rendezvous
    from rstar_hpc.exchange.reader import StepReader, consumer_cursors
    from rstar_hpc.exchange.state import read_stage_state

    paths = _paths(run)
    console = Console(width=140)
    now = time.time()
    console.print(f"[bold]run[/] {paths.name}  ({paths.dir})")

    stages = sorted(set(paths.stages()) | set(paths.traj_stages()))
    table = Table("stage", "status", "step", "data cursor", "policy", "job", "updated", "latest ckpt",
                  "traj steps (committed)", "consumers (next step)", "message", title="stages")
    for stage in stages:
        s = read_stage_state(paths, stage)
        latest = paths.checkpoints(stage).latest()
        reader = StepReader(paths, stage)
        steps = paths.traj_steps(stage)
        committed = [st for st in steps if reader.commits(st)]
        traj = f"{committed[0]}..{committed[-1]} ({len(committed)})" if committed else "-"
        cursors = ", ".join(f"{k}={v}" for k, v in consumer_cursors(paths, stage).items()) or "-"
        updated = _age(now - s.updated_at) if paths.stage_state(stage).exists() else "never"
        color = {"DONE": "green", "RUNNING": "cyan", "FAILED": "red"}.get(s.status, "")
        table.add_row(stage, f"[{color}]{s.status}[/]" if color else s.status, str(s.step), str(s.data_cursor),
                      str(s.policy_version), s.slurm_job_id or "-", updated,
                      latest[1].name if latest else "-", traj, cursors, s.message)
    if stages:
        console.print(table)
    else:
        console.print("no stage has started yet")
    policy = paths.policies().latest()
    console.print(f"published policy: {policy[1].name if policy else 'none'}")

    roles = rendezvous.read_roles(paths.dir)
    table = Table("role", "name", "address", "pid", "job", "started", "updated", "extra", title="announcements")
    for role, records in roles.items():
        for r in records:
            age = now - r["updated_at"]
            updated = _age(age) + (" [red](stale)[/]" if age > stale_after_s else "")
            extra = {k: v for k, v in r.items() if k not in rendezvous.REQUIRED_KEYS}
            table.add_row(role, r["name"], f"{r['host']}:{r['port']}", str(r["pid"]), r["slurm_job_id"] or "-",
                          _age(now - r["started_at"]), updated, ", ".join(f"{k}={v}" for k, v in extra.items()))
    if table.row_count:
        console.print(table)
    else:
        console.print("no role has announced itself")


def _age(seconds: float) -> str:
    seconds = max(seconds, 0)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"
