"""`rstar-hpc run status|logs|cancel`: follow a run that `rstar-hpc launch` started (or any run directory)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import click

from rstar_hpc.cli.exit_codes import run_paths as _paths


@click.group("run")
def command() -> None:
    """Follow a run: where each stage stands, what each role is doing, its jobs, its logs; cancel it.

    RUN is a run directory, or a run name under $RSTAR_HPC_RUN_ROOT.
    """


def _load(run: str):
    from rstar_hpc.config import load_config

    paths = _paths(run)
    return (load_config(str(paths.config)) if paths.config.is_file() else None), paths


@command.command("status")
@click.argument("run")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (stable keys; see rstar_hpc.launch.status).")
@click.option("--watch", is_flag=True, help="Redraw every --interval seconds until interrupted (or the run is done).")
@click.option("--interval", type=float, default=10.0, show_default=True, help="Seconds between redraws (--watch).")
@click.option("--no-slurm", is_flag=True, help="Do not ask Slurm about the run's jobs (run directory only).")
@click.option("--files", is_flag=True, help="The run directory's own view: data cursors, checkpoints, trajectory "
              "steps, consumers, announcements (also what a run without config.yaml shows).")
def status(run: str, as_json: bool, watch: bool, interval: float, no_slurm: bool, files: bool) -> None:
    """Per stage: state, steps done/total, step time breakdown (generation, tool calls, reward, training,
    checkpoint), ETA, last reward and pass@1; each role's job and last heartbeat; and what looks wrong, in words."""
    from rstar_hpc.launch.status import run_status
    from rstar_hpc.launch.launcher import slurm_env

    cfg, paths = _load(run)
    if cfg is None or files:
        if as_json:
            raise click.ClickException(f"{paths.dir} has no config.yaml: --json needs a run that `rstar-hpc launch` "
                                       f"or a role started")
        _directory_view(paths)
        return
    env = None if no_slurm else slurm_env()
    while True:
        st = run_status(cfg, paths, env, with_slurm=not no_slurm)
        if as_json:
            click.echo(json.dumps(st, default=str))
        else:
            if watch:
                click.clear()
            _render(st)
        if not watch or st["done"]:
            return
        time.sleep(interval)


def _fmt_s(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def _render(st: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from rstar_hpc.launch.status import _dur, rollout_idle, sandbox_losses, trainer_idle

    console = Console(width=160)
    console.print(f"[bold]run[/] {st['run']}  ({st['dir']})" + ("  [green]DONE[/]" if st["done"] else "")
                  + ("  [yellow]cancelled[/]" if st["cancelled"] else ""))
    table = Table("stage", "kind", "state", "step", "gen s", "tools s/traj", "reward s", "train s", "ckpt s", "ETA",
                  "reward", "pass@1", title="stages (mean seconds per step; a trajectory's tool wait overlaps generation)")
    colors = {"done": "green", "running": "cyan", "failed": "red"}
    for s in st["stages"]:
        t = s["timing"]
        pass1 = ", ".join(f"{b} {m['pass1']:.3f}±{m['stderr']:.3f}" for b, m in s.get("pass1", {}).items()) or "-"
        state = f"[{colors[s['state']]}]{s['state']}[/]" if s["state"] in colors else s["state"]
        table.add_row(s["name"], s["kind"], state, f"{s['step']}/{s['steps'] if s['steps'] is not None else '?'}",
                      _fmt_s(t["generation_s"]), _fmt_s(t["tool_wait_per_traj_s"]), _fmt_s(t["reward_s"]),
                      _fmt_s(t["training_s"]), _fmt_s(t["checkpoint_s"]), _dur(s["eta_s"]),
                      "-" if s["last_reward"] is None else f"{s['last_reward']:.3f}", pass1)
    console.print(table)
    if st["jobs"]:
        jobs = Table("role", "job", "state", "reason", "nodes", "elapsed", "restarts", title="jobs")
        for j in st["jobs"]:
            jobs.add_row(j["role"], j["job_id"], j["state"], j["reason"], j["nodes"], j["elapsed"], str(j["restarts"]))
        console.print(jobs)
    roles = Table("role", "doing", "last heartbeat", "host", "job", title="roles")
    for role, beat in st["roles"].items():
        roles.add_row(role, *(("(never heard from)", "-", "-", "-") if beat is None else
                              (beat["doing"], f"{_dur(beat['age_s'])} ago", beat["host"] or "-", beat["job"] or "-")))
    console.print(roles)
    engines = (st["roles"].get("rollout") or {}).get("engines")
    if engines:   # rank 0's judgment of each engine in the step (rollout/roster.py)
        table = Table("engine rank", "state", "last moved", "doing", title="rollout engines")
        for rank, e in engines.items():
            table.add_row(rank, e["state"], f"{_dur(e['moved_s_ago'])} ago", e.get("doing", "-"))
        console.print(table)
    seen = [t for t in st.get("placement", []) if t["observed"]]
    if seen:   # one row per node a role's tasks said they ran on
        place = Table("role", "node", "ranks", "GPUs each task computes on", "CPUs per task",
                      title=f"placement (observed by {len(seen)} of {len(st['placement'])} tasks)")
        for key in dict.fromkeys((t["role"], t["observed"]["node"] or t["observed"]["host"]) for t in seen):
            on = [t for t in seen if (t["role"], t["observed"]["node"] or t["observed"]["host"]) == key]
            place.add_row(key[0], key[1], ",".join(str(t["rank"]) for t in on),
                          " | ".join(",".join(map(str, t["observed"].get("devices") or [])) or "-" for t in on),
                          ",".join(str(t["observed"]["cpus"]) for t in on))
        console.print(place)
    if (weights := st.get("weights")) and weights.get("text"):
        console.print(weights["text"])
    if idle := trainer_idle(st["dir"]):
        console.print(idle["text"])
    if idle := rollout_idle(st["dir"], {s["name"] for s in st["stages"] if s["kind"] == "rl"}):
        console.print(idle["text"])
    if lost := sandbox_losses(st["dir"]):
        console.print(f"[yellow]{lost['text']}[/]")
    for p in st["problems"]:
        console.print(f"[red]problem:[/] {p}")


def _directory_view(paths, stale_after_s: float = 120.0) -> None:
    """What the run directory alone says (no config needed): stage states, cursors, checkpoints, trajectory steps,
    consumers, and each role's announcements."""
    from rich.console import Console
    from rich.table import Table

    from rstar_hpc.exchange import rendezvous
    from rstar_hpc.exchange.reader import StepReader, consumer_cursors
    from rstar_hpc.exchange.state import read_stage_state

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


@command.command("logs")
@click.argument("run")
@click.option("--role", type=click.Choice(["trainer", "rollout", "sandbox", "supervisor"]), default=None,
              help="One role's log [all of the newest job's].")
@click.option("-f", "--follow", is_flag=True, help="Keep printing what is appended (tail -F).")
@click.option("-n", "--lines", type=int, default=50, show_default=True, help="Lines of each log to start with.")
def logs(run: str, role: str | None, follow: bool, lines: int) -> None:
    """The logs of the run's newest job: RUN/logs/<role>-<job>.log (the supervisor's: run-<job>.out)."""
    paths = _paths(run)
    files = _log_files(paths, role)
    if not files:
        raise click.ClickException(f"no logs under {paths.logs} yet" + (f" for {role}" if role else ""))
    cmd = ["tail", f"-n{lines}", *(["-F"] if follow else []), *map(str, files)]
    try:
        sys.exit(subprocess.call(cmd))
    except KeyboardInterrupt:
        pass


def _log_files(paths, role: str | None) -> list:
    """The newest log of each role (by modification time), or of `role`."""
    names = {"supervisor": "run-"} if role == "supervisor" else \
        {r: f"{r}-" for r in ([role] if role else ["trainer", "rollout", "sandbox"])}
    if role is None:
        names["supervisor"] = "run-"
    out = []
    for prefix in names.values():
        found = sorted((p for p in paths.logs.glob(f"{prefix}*") if p.is_file()), key=lambda p: p.stat().st_mtime)
        if found:
            out.append(found[-1])
    return out


@command.command("cancel")
@click.argument("run")
def cancel(run: str) -> None:
    """Cancel every job of the run and mark it cancelled, so no job requeues itself. The run directory stays as
    it is: `rstar-hpc launch RUN/config.yaml` continues the run."""
    from rstar_hpc.launch.record import current_jobs, mark_cancelled
    from rstar_hpc.launch.launcher import slurm_env

    paths = _paths(run)
    jobs = current_jobs(paths)
    mark_cancelled(paths)   # first: a supervisor that sees its job end must not requeue it
    if not jobs:
        click.echo(f"run {paths.name} has no recorded jobs; marked cancelled")
        return
    env = slurm_env()
    proc = subprocess.run(["scancel", *jobs.values()], capture_output=True, text=True, env=env, timeout=60)
    if proc.returncode:
        raise click.ClickException(f"scancel {' '.join(jobs.values())} failed: {proc.stderr.strip()}")
    click.echo(f"cancelled {', '.join(f'{r} job {j}' for r, j in jobs.items())} of run {paths.name}; "
               f"`rstar-hpc launch {paths.config}` continues it")
