"""`rstar-hpc demo`: the README's main job on the embedded default config."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click

from rstar_hpc.cli.status import EXIT_FAILED
from rstar_hpc.config.loader import DEFAULT_CONFIG


def _step(i: int, n: int, text: str) -> None:
    click.echo(click.style(f"[{i}/{n}] {text}", bold=True))


@click.command("demo")
@click.argument("config", default=DEFAULT_CONFIG)
@click.argument("overrides", nargs=-1)
@click.option("--state-dir", type=click.Path(file_okay=False), default=None, help="Local cluster state directory.")
@click.option("--keep-cluster", is_flag=True, help="Leave a cluster this demo started running afterwards.")
@click.option("--timeout-s", default=900, show_default=True, help="Give up on the Slurm job after this long.")
def command(config: str, overrides: tuple[str, ...], state_dir, keep_cluster: bool, timeout_s: int) -> None:
    """Bring up the local Slurm cluster, run `doctor`, build the tiny model, and run a real Slurm job
    (sbatch/generate.sbatch) that samples from it in vLLM; print what it generated and how fast.

    A cluster that was already up is left up; one the demo started is stopped at the end (unless
    --keep-cluster).
    """
    from rstar_hpc.cluster import LocalCluster
    from rstar_hpc.config import load_config, prepare_run_dir
    from rstar_hpc.doctor import FAIL, run_checks
    from rstar_hpc.launch import submit, wait_for_job
    from rstar_hpc.models.resolve import resolve_model

    cfg = load_config(config, overrides)     # a bad config fails here, before anything starts
    n = 4
    _step(1, n, "local Slurm cluster")
    cluster = LocalCluster(state_dir)
    was_up = cluster.is_up()
    cluster.up()
    click.echo(f"      {'already up' if was_up else 'started'}: nodes {', '.join(cluster.node_names)} "
               f"(SLURM_CONF={cluster.conf})")
    try:
        _step(2, n, "doctor")
        os.environ["SLURM_CONF"] = str(cluster.conf)
        checks = run_checks(cfg.run.root_dir)
        for c in checks:
            click.echo(f"      {c.status:>4}  {c.name:<8} {c.detail}" + (f"\n            fix: {c.fix}" if c.fix else ""))
        if any(c.status == FAIL for c in checks):
            click.echo("doctor found failures: fix them (see above) and run the demo again", err=True)
            sys.exit(EXIT_FAILED)

        _step(3, n, "tiny model")
        t0 = time.perf_counter()
        model_dir = resolve_model(cfg)
        click.echo(f"      {model_dir} ({time.perf_counter() - t0:.1f} s)")

        _step(4, n, "Slurm job: sample from the tiny model in vLLM (sbatch/generate.sbatch)")
        paths = prepare_run_dir(cfg)
        env = {**cluster.env, "RSTAR_HPC_RUN_ROOT": str(cfg.run.root_dir),
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        job_id = submit("generate", [config, *overrides], env=env,
                        sbatch_args=[f"--output={paths.logs}/generate-%j.out", f"--chdir={Path.cwd()}"])
        click.echo(f"      submitted job {job_id}; log {paths.logs}/generate-{job_id}.out")
        t0 = time.perf_counter()
        last = {}

        def show(fields: dict) -> None:
            state = (fields.get("JobState"), fields.get("NodeList"))
            if state != last.get("s"):
                last["s"] = state
                click.echo(f"      {time.perf_counter() - t0:5.1f} s  {state[0]} on {state[1]}")

        wait_for_job(job_id, timeout_s=timeout_s, env=env, on_poll=show)
        out_dir = paths.generate_dir(job_id)
        summary = json.loads((out_dir / "summary.json").read_text())
        first = json.loads((out_dir / "samples.jsonl").read_text().splitlines()[0])
        click.echo(f"      done in {time.perf_counter() - t0:.1f} s on node {summary['slurm_node']}: "
                   f"{summary['num_samples']} samples, {summary['num_generated_tokens']} tokens, "
                   f"{summary['tokens_per_s']} tokens/s (engine start {summary['engine_start_s']} s)")
        click.echo(f"      first sample ({first['question']}, untrained model): {first['text'][:120]!r}")
        click.echo(f"      logprobs of its first tokens: {[round(x, 2) for x in first['logprobs'][:5]]}")
        click.echo(f"outputs: {out_dir}")
    finally:
        if not was_up and not keep_cluster:
            cluster.down()
            click.echo("local cluster stopped (it was started by this demo; --keep-cluster keeps it)")
