"""`rstar-hpc export RUN|CKPT_DIR [--stage S] [--step N] OUT`: a trainer checkpoint as a Hugging Face model
directory (rstar_hpc/export/)."""
from __future__ import annotations

import click


@click.command("export")
@click.argument("source", metavar="RUN|CKPT_DIR")
@click.argument("out", type=click.Path(file_okay=True))
@click.option("--stage", default=None, help="The trainer stage whose checkpoint to export [the newest stage's].")
@click.option("--step", type=click.IntRange(min=0), default=None, help="The checkpoint's step [the stage's newest].")
def command(source: str, out: str, stage: str | None, step: int | None) -> None:
    """Export a committed trainer checkpoint as a Hugging Face model directory OUT: safetensors (tensor and
    pipeline shards merged), config, the tokenizer with the training chat template (the rStar2 system prompt with
    the python tool, <tool_call> and <answer> tags), and generation_config.json with the run's sampling.

    RUN is a run directory (or a run name under $RSTAR_HPC_RUN_ROOT): its newest checkpoint, or the one --stage
    and --step name. CKPT_DIR is RUN/ckpt/<stage> (its newest) or RUN/ckpt/<stage>/step-N. Any committed
    checkpoint works, not only the policies kept under RUN/policy. Runs on a login node: no GPU, one process.
    """
    import warnings

    from rstar_hpc.cli.exit_codes import NotFound
    from rstar_hpc.export import export_model
    from rstar_hpc.export.choose import RunNotFound

    # megatron-core's and torch.distributed.checkpoint's notes on this CPU build, not the user's business
    warnings.filterwarnings("ignore", module=r"megatron\.")
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|ShardedTensor|load_state_dict).*")
    try:
        done = export_model(source, out, stage=stage, step=step)
    except RunNotFound as e:
        raise NotFound(str(e)) from None
    gen = done.generation
    click.echo(f"exported {done.checkpoint} to {done.out}", err=True)
    click.echo(f"  sampling (generation_config.json): temperature {gen.get('temperature')}, top-p "
               f"{gen.get('top_p')}, max_new_tokens {gen.get('max_new_tokens')}", err=True)
    click.echo(f"  load it: AutoModelForCausalLM.from_pretrained('{done.out}'), or `vllm serve {done.out}`", err=True)
    click.echo(str(done.out))
