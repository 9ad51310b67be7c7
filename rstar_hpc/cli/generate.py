"""`rstar-hpc generate`: sample from the policy in vLLM (the demo's job; a rollout node smoke test)."""
from __future__ import annotations

import json
from pathlib import Path

import click

from rstar_hpc.config.loader import DEFAULT_CONFIG


@click.command("generate")
@click.argument("config", default=DEFAULT_CONFIG)
@click.argument("overrides", nargs=-1)
@click.option("--num-prompts", default=8, show_default=True, help="Prompts to sample (one sample each).")
@click.option("--max-tokens", default=64, show_default=True, help="Tokens generated per sample.")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Output directory [<run dir>/generate/<SLURM_JOB_ID or 'local'>].")
def command(config: str, overrides: tuple[str, ...], num_prompts: int, max_tokens: int, out) -> None:
    """Load the policy of CONFIG (building the tiny model if the config asks for one) into vLLM, sample
    math prompts in the rStar2 format, and write token ids, per-token logprobs and text as JSONL.

    CONFIG is a config name (`rstar-hpc config show --list`) or a YAML path; OVERRIDES are dotted key=value pairs.
    """
    import os

    from rstar_hpc.config import load_config
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.rollout.generate import run_generate

    cfg = load_config(config, overrides)
    out_dir = Path(out) if out else RunPaths(cfg.run.dir).generate_dir(os.environ.get("SLURM_JOB_ID", "local"))
    summary = run_generate(cfg, out_dir, num_prompts=num_prompts, max_tokens=max_tokens)
    click.echo(f"wrote {summary['num_samples']} samples to {out_dir}/samples.jsonl")
    click.echo(json.dumps(summary))
