"""What makes an exported model serve the way it was trained: the tokenizer with the training chat template, and
`generation_config.json` with the recipe's sampling (transformers' `generate` and vLLM's defaults both read it)."""
from __future__ import annotations

from pathlib import Path

from rstar_hpc.config import RunConfig
from rstar_hpc.export.choose import ExportError
from rstar_hpc.models import chat_format as fmt


def training_system_prompt(cfg: RunConfig) -> str:
    """The system turn the run's rollout rendered (rollout.agent.encode_prompt): `system_prompt` as it is, else the
    rStar2 preamble with the python tool's schema (the stateful tool's wording with tool_state session)."""
    agent = cfg.rollout.agent
    if agent.system_prompt is not None:
        return agent.system_prompt
    return fmt.system_prompt([fmt.SESSION_TOOL_SCHEMA] if agent.tool_state == "session" else None)


def max_response_tokens(cfg: RunConfig, stage: str) -> int:
    """The response budget the checkpoint's stage trained with (an rl stage's own, else rollout.agent's)."""
    own = next((getattr(s, "max_response_length", None) for s in cfg.stages if s.name == stage), None)
    return own or cfg.rollout.agent.max_response_length


def write_tokenizer(out: Path, model_dir: Path, cfg: RunConfig) -> None:
    """The model's tokenizer with the training chat template in place of the base model's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    for marker in (fmt.IM_START, fmt.IM_END, fmt.ENDOFTEXT):
        if tok.convert_tokens_to_ids(marker) in (None, tok.unk_token_id):
            raise ExportError(f"{model_dir}: the tokenizer has no {marker!r} token; the rStar2 format needs a ChatML "
                             f"tokenizer (Qwen's)")
    tok.chat_template = fmt.serving_chat_template(training_system_prompt(cfg))
    tok.eos_token = fmt.IM_END   # a chat turn ends there; the base model's may be <|endoftext|>
    tok.save_pretrained(out)


def write_generation_config(out: Path, model_dir: Path, cfg: RunConfig, stage: str) -> dict:
    """generation_config.json: the rollout's temperature, top-p and top-k, the stage's response budget as
    max_new_tokens, and a stop at <|im_end|> (end of the assistant turn) or <|endoftext|>. Returns what it wrote."""
    from transformers import AutoTokenizer, GenerationConfig

    agent = cfg.rollout.agent
    tok = AutoTokenizer.from_pretrained(out)
    try:
        gen = GenerationConfig.from_pretrained(model_dir)
    except OSError:   # the base model ships none
        gen = GenerationConfig()
    sampling = {"do_sample": True, "temperature": agent.temperature, "top_p": agent.top_p,
                "top_k": max(agent.top_k, 0)}   # -1 (vLLM's "off") is 0 here; transformers' default would be 50
    if agent.temperature == 0:
        sampling = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    gen.update(**sampling, max_new_tokens=max_response_tokens(cfg, stage),
               eos_token_id=[tok.convert_tokens_to_ids(fmt.IM_END), tok.convert_tokens_to_ids(fmt.ENDOFTEXT)],
               pad_token_id=tok.convert_tokens_to_ids(fmt.ENDOFTEXT))
    gen.save_pretrained(out)
    return gen.to_diff_dict()
