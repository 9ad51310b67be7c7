"""Tiny models of each family the trainer builds, made on the fly: no model hub is reachable on compute nodes or
in CI.

`make_tiny_model(out_dir, spec)` trains a byte-level BPE tokenizer on a built-in corpus of the rStar2
format (digits split one per token; ChatML markers as special tokens; the rStar2 tags as single,
non-special tokens so decoding keeps them), attaches the rStar2 chat template, and writes a random-init model of
`spec.family` with transformers' own class (`Qwen3ForCausalLM`, `Qwen2ForCausalLM` with tied embeddings,
`LlamaForCausalLM` with Llama 3's RoPE scaling, or `Qwen3MoeForCausalLM` with `spec.num_experts` experts) in Hugging Face format (float32 safetensors) that vLLM and the
trainer load. The same spec gives byte-identical files; building takes a couple of seconds.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from rstar_hpc.config.run import TinyModelSpec
from rstar_hpc.models import chat_format as fmt

BUILD_MARKER = "rstar_tiny_model.json"   # written last: a directory without it is an unfinished build


def _corpus(seed: int, n: int = 1500) -> list[str]:
    """Text in the shapes the model will see: prompts, reasoning, tool calls and results, answers, code."""
    rng = random.Random(seed)
    ops = [("*", lambda a, b: a * b), ("+", lambda a, b: a + b), ("-", lambda a, b: a - b)]
    words = ("compute the value of let we need find sum product number integer answer so first then check "
             "result is equals total remainder divide multiply add subtract square root prime factor count "
             "how many what each the a of to and in for with").split()
    lines = [fmt.system_prompt(), fmt.USER_PREFIX]
    for _ in range(n):
        a, b = rng.randint(0, 99999), rng.randint(0, 9999)
        sym, f = rng.choice(ops)
        prose = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
        code = rng.choice([f"print({a} {sym} {b})", f"x = {a}\ny = {b}\nprint(x {sym} y)",
                           f"import math\nprint(math.gcd({a}, {b}))", f"for i in range({b % 10}):\n    print(i)",
                           f"import sympy\nprint(sympy.factorint({a}))"])
        lines.append(fmt.render_prompt(f"Compute {a} {sym} {b}. {prose}."))
        lines.append(f"{prose}. {fmt.render_tool_call(code)}{fmt.IM_END}")
        lines.append(fmt.render_tool_responses([f"Tool call success\nstdout: {f(a, b)}\nexecution time: 0.01s"]))
        lines.append(f"{prose} </reason>\n<answer>\\boxed{{{f(a, b)}}}</answer>{fmt.IM_END}")
    return lines


def build_tokenizer(spec: TinyModelSpec):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=fmt_special_pattern(), behavior="isolated"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    n_added = len(fmt.CHATML_TOKENS) + len(fmt.RSTAR_TAGS)
    trainer = trainers.BpeTrainer(
        vocab_size=max(spec.vocab_size - n_added, 256 + 1), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in fmt.CHATML_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in fmt.RSTAR_TAGS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=fmt.IM_END, pad_token=fmt.ENDOFTEXT, unk_token=None,
        chat_template=fmt.CHAT_TEMPLATE, model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )


def fmt_special_pattern():
    # keep the markers whole before byte-level splitting, so BPE never learns merges across them
    from tokenizers import Regex

    markers = list(fmt.CHATML_TOKENS) + list(fmt.RSTAR_TAGS)
    return Regex("|".join(m.replace("|", r"\|") for m in markers))


def _family_config(spec: TinyModelSpec) -> tuple[str, dict]:
    """(transformers' class name prefix, the config's family-specific arguments)."""
    if spec.family == "qwen2":   # q/k/v biases are Qwen2's own; tied as Qwen2.5 up to 3B
        return "Qwen2", dict(rms_norm_eps=1e-6, rope_theta=1_000_000.0)
    if spec.family == "llama":
        # every regime of Llama 3's scaling at head_dim 32: wavelengths below original/4 kept, above original
        # divided by factor, a mix between
        return "Llama", dict(rms_norm_eps=1e-5, rope_theta=500_000.0, attention_bias=False, mlp_bias=False,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": spec.max_position_embeddings // 4})
    if spec.family == "qwen3_moe":   # top-k weights renormalised, as Qwen3-30B-A3B
        return "Qwen3Moe", dict(rms_norm_eps=1e-6, rope_theta=1_000_000.0, attention_bias=False,
                                num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                                moe_intermediate_size=spec.moe_intermediate_size, norm_topk_prob=True,
                                router_aux_loss_coef=spec.router_aux_loss_coef, decoder_sparse_step=1,
                                mlp_only_layers=[])
    return "Qwen3", dict(rms_norm_eps=1e-6, rope_theta=1_000_000.0, attention_bias=False)


def build_model(spec: TinyModelSpec, tokenizer):
    import torch
    import transformers
    from transformers import GenerationConfig

    name, family_args = _family_config(spec)
    vocab = len(tokenizer)
    config = getattr(transformers, f"{name}Config")(
        vocab_size=vocab, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=spec.tied,
        torch_dtype="float32", **family_args,
        bos_token_id=tokenizer.convert_tokens_to_ids(fmt.ENDOFTEXT),
        eos_token_id=tokenizer.convert_tokens_to_ids(fmt.IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(fmt.ENDOFTEXT),
    )
    torch.manual_seed(spec.seed)
    model = getattr(transformers, f"{name}ForCausalLM")(config).to(torch.float32)
    gen = GenerationConfig(eos_token_id=[config.eos_token_id, config.bos_token_id],
                           pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id)
    return model, gen


def make_tiny_model(out_dir: str | os.PathLike, spec: TinyModelSpec | None = None, *, force: bool = False) -> Path:
    """Build (or reuse) a tiny model directory. Concurrent builders are safe: each builds in a private
    temporary directory beside `out_dir` and renames it into place; the loser keeps the winner's result."""
    spec = spec or TinyModelSpec()
    out = Path(out_dir).expanduser().absolute()
    if is_tiny_model(out, spec) and not force:
        return out
    if out.exists() and not force and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not a tiny model built from this spec; pass force=True "
                              f"(--force) to replace it, or choose another directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tokenizer = build_tokenizer(spec)
        model, gen = build_model(spec, tokenizer)
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp, safe_serialization=True)
        gen.save_pretrained(tmp)
        num_params = sum(p.numel() for p in model.parameters())
        (tmp / BUILD_MARKER).write_text(json.dumps(
            {"spec": spec.model_dump(), "fingerprint": spec.fingerprint(), "num_params": num_params,
             "vocab_size": len(tokenizer), "files": _digests(tmp)}, indent=2, sort_keys=True))
        if out.exists():
            shutil.rmtree(out)
        try:
            os.rename(tmp, out)
        except OSError:
            if not is_tiny_model(out, spec):   # someone else renamed a different thing into place
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def is_tiny_model(path: str | os.PathLike, spec: TinyModelSpec | None = None) -> bool:
    marker = Path(path) / BUILD_MARKER
    if not marker.is_file():
        return False
    if spec is None:
        return True
    return json.loads(marker.read_text()).get("fingerprint") == spec.fingerprint()


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}
