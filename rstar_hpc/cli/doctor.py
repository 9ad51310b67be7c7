"""`rstar-hpc doctor`: preflight checks with a fix for each failure."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from rstar_hpc.cli.exit_codes import EXIT_FAILED


@click.command("doctor")
@click.option("--run-root", type=click.Path(file_okay=False), default=None,
              help="Run-directory root to test for writes [$RSTAR_HPC_RUN_ROOT or ./runs].")
@click.option("--skip", multiple=True,
              help="Skip a check (repeatable): bwrap slurm mpi vllm gpus placement run-dir offline shm.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def command(run_root, skip, as_json: bool) -> None:
    """Preflight a node or login host: bwrap sandboxes for this user, Slurm reachable, MPI runs, vLLM importable
    (CPU or CUDA build), GPUs visible, run directory writable, offline settings. Inside a job step (srun ... rstar-hpc
    doctor) it also prints the task's placement: node, CUDA_VISIBLE_DEVICES and the CPUs of its affinity.

    Prints a table with a concrete fix for each problem. Exit status 0 when nothing failed (warnings allowed),
    1 otherwise.
    """
    from rich.console import Console
    from rich.table import Table

    from rstar_hpc.config.run import RunSection
    from rstar_hpc.doctor import FAIL, WARN, run_checks

    root = Path(run_root).absolute() if run_root else RunSection().root_dir
    results = run_checks(root, tuple(skip))
    failed = [r for r in results if r.status == FAIL]
    if as_json:
        click.echo(json.dumps([r.__dict__ for r in results], indent=2))
    else:
        table = Table("check", "status", "detail", "fix", show_lines=False)
        color = {FAIL: "red", WARN: "yellow"}
        for r in results:
            c = color.get(r.status, "green")
            table.add_row(r.name, f"[{c}]{r.status}[/{c}]", r.detail, r.fix)
        console = Console(width=max(Console().width, 140))
        console.print(table)
        console.print(f"{len(failed)} failed, {sum(r.status == WARN for r in results)} warnings")
    sys.exit(EXIT_FAILED if failed else 0)
