"""`rstar-hpc sandbox serve|exec|stats`: run the bubblewrap sandbox service or call one.

Imports only click and the stdlib-only `sandbox` package (plus the config, when one is named), so it stays fast
and never pulls in torch. `serve` is also the sandbox role's job entry (jobs/sandbox_service.py, one per node).
"""
from __future__ import annotations

import asyncio
import json
import os
import sys

import click


@click.group("sandbox")
def command() -> None:
    """Run or call the bubblewrap Python sandbox service (see `python -c 'import sandbox; help(sandbox)'`
    for the threat model)."""


def _settings(workers: int | None, config: str | None, overrides: tuple[str, ...]):
    """(Limits, stats interval in s): the `sandbox` section of CONFIG + OVERRIDES, or the service's defaults."""
    from sandbox.limits import Limits

    limits, stats_interval_s = Limits(), 30.0
    if config or overrides:
        from rstar_hpc.config import load_config
        section = load_config(config or "tiny-cpu", overrides).sandbox
        limits, stats_interval_s = section.to_limits(), section.stats_interval_s
    if workers:
        limits.num_workers = workers
    return limits, stats_interval_s


def _node() -> str:
    return os.environ.get("SLURMD_NODENAME") or os.uname().nodename


def _slurm_name() -> str | None:
    """Under Slurm, `<node>-<job id>-<task>`: one name per service of the job (nodes are its first part)."""
    if "SLURM_JOB_ID" not in os.environ:
        return None
    return f"{_node()}-{os.environ['SLURM_JOB_ID']}-{os.environ.get('SLURM_PROCID', '0')}"


@command.command("serve")
@click.option("--workers", type=int, default=None, help="Sandboxes in the pool (default: one per core).")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="Announce the service and write stats under this run directory.")
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=0, show_default=True, help="Port (0: any free port).")
@click.option("--announce-host", default=None,
              help="Host name clients connect to, as announced (default: this node's hostname).")
@click.option("--name", default=None,
              help="Announcement name (default: <node>-<job id>-<task> under Slurm, else <hostname>-<pid>).")
@click.option("--config", default=None, help="Run config to take sandbox.* knobs from.")
@click.option("--stats-interval", type=float, default=None,
              help="Seconds between stats lines [sandbox.stats_interval_s of the config, else 30].")
@click.argument("overrides", nargs=-1)
def serve(workers, run_dir, host, port, announce_host, name, config, stats_interval, overrides) -> None:
    """Run a pool service on this node until SIGTERM. OVERRIDES are dotted sandbox.* settings."""
    from rstar_hpc.logs import init_logging
    from sandbox.server import Service, run_loop

    init_logging("sandbox", _node())
    if run_dir and os.environ.get("RSTAR_BIND") == "1":   # started by the run's launcher: say where it runs
        from rstar_hpc.exchange.placement import record_placement
        from rstar_hpc.exchange.rundir import RunPaths
        record_placement(RunPaths(run_dir), "sandbox")
    from rstar_hpc.cli.exit_codes import refusing

    with refusing("sandbox"):
        limits, config_interval_s = _settings(workers, config, overrides)
    svc = Service(limits, host=host, port=port, run_dir=run_dir, name=name or _slurm_name(),
                  announce_host=announce_host, stats_interval_s=stats_interval or config_interval_s)
    run_loop(svc.serve_forever())


@command.command("exec")
@click.option("--address", default=None, help="HOST:PORT of a running service (default: a local pool).")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="Use the services announced in this run directory.")
@click.option("--workers", type=int, default=None, help="Local pool size when no service is named.")
@click.option("--render", is_flag=True, help="Add the rStar2 tool-response text as field 'text'.")
def exec_(address, run_dir, workers, render) -> None:
    """Run JSON-line requests from stdin; write one JSON result line per request, in input order.

    A request: {"id": ..., "code": "...", "stdin": "", "session": null, "timeout_s": 4}. A malformed line
    gets status invalid_request with a message and the batch goes on.
    """
    lines = sys.stdin.read().splitlines()
    from sandbox.server import run_loop
    results = run_loop(_exec(lines, address, run_dir, workers))
    from sandbox.results import render_rstar2
    for r in results:
        if render:
            r["text"] = render_rstar2(r)
        sys.stdout.write(json.dumps(r) + "\n")
    sys.stdout.flush()


async def _exec(lines: list[str], address: str | None, run_dir: str | None, workers: int | None) -> list[dict]:
    from sandbox.results import make_result

    parsed: list[tuple[dict | None, dict | None]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            parsed.append((None, make_result(None, "invalid_request", f"line {n}: not JSON: {e}")))
            continue
        parsed.append((obj, None))
    if address or run_dir:
        from sandbox.client import SandboxClient
        from sandbox.limits import Limits
        from sandbox.protocol import validate_call

        async with SandboxClient([address] if address else None, run_dir=run_dir) as client:
            def go(obj):
                # the service validates too; checking here keeps a bad line from costing a round trip
                call, bad = validate_call(obj, Limits(max_timeout_s=600))
                return bad if bad is not None else client.submit(obj)
            futs = [bad if obj is None else go(obj) for obj, bad in parsed]
            return [f if isinstance(f, dict) else await f for f in futs]
    from sandbox.pool import Pool
    from sandbox.protocol import validate_call

    async with Pool(_settings(workers, None, ())[0]) as pool:
        futs = []
        for obj, bad in parsed:
            if bad is None:
                call, bad = validate_call(obj, pool.limits)
            futs.append(bad if bad is not None else pool.submit(call))
        return [f if isinstance(f, dict) else await f for f in futs]


@command.command("stats")
@click.option("--address", default=None, help="HOST:PORT of a service.")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None, help="All services of a run.")
def stats(address, run_dir) -> None:
    """Print the stats record of each service as JSON."""
    from sandbox.client import SandboxClient

    async def go():
        async with SandboxClient([address] if address else None, run_dir=run_dir) as client:
            return await client.stats()
    click.echo(json.dumps(asyncio.run(go()), indent=1))
