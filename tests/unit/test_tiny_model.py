"""make-tiny-model: deterministic, the rStar2 tags are single tokens, the chat template is the format's."""
from __future__ import annotations

import json

import pytest

from rstar_hpc.config.run import TinyModelSpec
from rstar_hpc.models import chat_format as fmt
from rstar_hpc.models.tiny import BUILD_MARKER, is_tiny_model, make_tiny_model


def test_same_seed_gives_identical_files_and_another_seed_does_not(tiny_model_dir, tmp_path):
    again = make_tiny_model(tmp_path / "again", TinyModelSpec())
    a = json.loads((tiny_model_dir / BUILD_MARKER).read_text())["files"]
    b = json.loads((again / BUILD_MARKER).read_text())["files"]
    assert a == b
    other = make_tiny_model(tmp_path / "other", TinyModelSpec(seed=1))
    c = json.loads((other / BUILD_MARKER).read_text())["files"]
    assert c["model.safetensors"] != a["model.safetensors"]


def test_reuses_a_finished_build_and_refuses_to_clobber(tiny_model_dir, tmp_path):
    mtime = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_model(tiny_model_dir, TinyModelSpec()) == tiny_model_dir
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == mtime
    assert is_tiny_model(tiny_model_dir, TinyModelSpec()) and not is_tiny_model(tiny_model_dir, TinyModelSpec(seed=5))
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a tiny model built from this spec"):
        make_tiny_model(occupied, TinyModelSpec())
    assert (occupied / "precious.txt").read_text() == "keep me"


def test_qwen3_architecture_as_specified(tiny_model_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    spec = TinyModelSpec()
    assert cfg.model_type == "qwen3"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    assert cfg.tie_word_embeddings is False


def test_tags_are_single_tokens_kept_by_decode_and_digits_split(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for tag in fmt.RSTAR_TAGS + fmt.CHATML_TOKENS:
        assert len(tok.encode(tag, add_special_tokens=False)) == 1, tag
    text = "<reason>12345 * 6</reason>\n<answer>\\boxed{74070}</answer>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == text      # tags survive skip_special_tokens
    digits = tok.encode("12345", add_special_tokens=False)
    assert len(digits) == 5
    assert tok.eos_token == fmt.IM_END


def test_chat_template_renders_exactly_the_rstar2_format(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    q = "Compute 12 * 34."
    messages = [{"role": "system", "content": fmt.system_prompt()},
                {"role": "user", "content": fmt.USER_PREFIX + q}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == fmt.render_prompt(q)
    # tools given to the template render the same Hermes section as system_prompt()
    with_tools = tok.apply_chat_template([{"role": "user", "content": fmt.USER_PREFIX + q}], tools=[fmt.TOOL_SCHEMA],
                                         tokenize=False, add_generation_prompt=True)
    assert with_tools == fmt.render_prompt(q)
    # consecutive tool results merge into one user turn, followed by the prefilled next turn
    convo = messages + [{"role": "assistant", "content": "x"}, {"role": "tool", "content": "a"},
                        {"role": "tool", "content": "b"}]
    full = tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    assert full.endswith(fmt.render_tool_responses(["a", "b"]))
