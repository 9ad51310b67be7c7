"""Model families (models/families.py): a config.json selects one, the published shapes are the published configs'
numbers, an unsupported model is refused at config load naming the families, and the planners read each shape."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from rstar_hpc.cli import cli, main
from rstar_hpc.cli.exit_codes import EXIT_CONFIG
from rstar_hpc.config import ConfigError, load_config
from rstar_hpc.models.families import FAMILIES, Llama3Rope, family_of
from rstar_hpc.models.shapes import PUBLISHED, ModelShape, published_shape

_LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192, "rope_type": "llama3"}

# the numbers of each model's config.json on the Hugging Face hub (the repository in the key), as published
CONFIGS = {
    "qwen2.5-7b": {   # Qwen/Qwen2.5-7B
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "vocab_size": 152064, "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
        "max_position_embeddings": 131072, "use_sliding_window": False, "rope_scaling": None},
    "qwen2.5-math-7b": {   # Qwen/Qwen2.5-Math-7B
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "vocab_size": 152064, "tie_word_embeddings": False, "rope_theta": 10000.0, "rms_norm_eps": 1e-06,
        "max_position_embeddings": 4096, "use_sliding_window": False},
    "qwen2.5-14b": {   # Qwen/Qwen2.5-14B
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 5120,
        "intermediate_size": 13824, "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
        "vocab_size": 152064, "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-05,
        "max_position_embeddings": 131072, "use_sliding_window": False},
    "qwen2.5-32b": {   # Qwen/Qwen2.5-32B
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 5120,
        "intermediate_size": 27648, "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
        "vocab_size": 152064, "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-05,
        "max_position_embeddings": 131072, "use_sliding_window": False},
    "llama-3.1-8b": {   # meta-llama/Llama-3.1-8B
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "tie_word_embeddings": False, "rope_theta": 500000.0, "rms_norm_eps": 1e-05,
        "max_position_embeddings": 131072, "attention_bias": False, "mlp_bias": False, "rope_scaling": _LLAMA31_ROPE},
    "llama-3.1-70b": {   # meta-llama/Llama-3.1-70B
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "vocab_size": 128256, "tie_word_embeddings": False, "rope_theta": 500000.0, "rms_norm_eps": 1e-05,
        "max_position_embeddings": 131072, "attention_bias": False, "mlp_bias": False, "rope_scaling": _LLAMA31_ROPE},
    "qwen3-30b-a3b": {   # Qwen/Qwen3-30B-A3B
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06, "max_position_embeddings": 40960, "use_sliding_window": False, "rope_scaling": None,
        "attention_bias": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 768,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "router_aux_loss_coef": 0.001},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_published_shapes_are_the_published_configs(name):
    assert ModelShape.from_hf_config(CONFIGS[name]) == PUBLISHED[name]


def test_parameter_counts_are_the_checkpoints():
    # model.safetensors.index.json total_size / 2 bytes (bf16) of meta-llama/Llama-3.1-8B, -70B, Qwen/Qwen2.5-7B
    assert PUBLISHED["llama-3.1-8b"].num_params == 16_060_522_496 // 2
    assert PUBLISHED["llama-3.1-70b"].num_params == 141_107_412_992 // 2
    assert PUBLISHED["qwen2.5-7b"].num_params == 15_231_233_024 // 2   # the q/k/v biases counted
    assert PUBLISHED["qwen2.5-14b"].num_params == pytest.approx(14.77e9, rel=1e-3)
    assert PUBLISHED["qwen2.5-32b"].num_params == pytest.approx(32.76e9, rel=1e-3)
    moe = PUBLISHED["qwen3-30b-a3b"]   # its name: 30.5B in all, 3.3B active (8 of 128 experts)
    assert (moe.num_params, moe.active_params) == (30_532_122_624, 3_353_032_704)


def test_moe_memory_counts_every_expert_and_flops_the_active_ones():
    from rstar_hpc.trainer.flops import model_flops
    from rstar_hpc.trainer.memory_plan import params_per_rank

    moe = PUBLISHED["qwen3-30b-a3b"]
    assert model_flops(moe, [1000], passes=1)[1] == moe.active_params - moe.vocab_size * moe.hidden_size - \
        moe.num_layers * moe.norm_params - moe.hidden_size   # the matmuls of the active parameters
    one, split = params_per_rank(moe, 1, 1), params_per_rank(moe, 1, 1, ep=8)
    assert one == pytest.approx(moe.num_params - moe.vocab_size * moe.hidden_size, rel=1e-6)   # one vocab matrix
    assert one - split == moe.num_layers * moe.expert_params * 7 // 8   # each of 8 ranks holds 16 experts


def test_a_config_selects_its_family_and_its_flags():
    assert {n: (f.qkv_bias, f.qk_norm) for n, f in FAMILIES.items()} == {
        "qwen3": (False, True), "qwen2": (True, False), "llama": (False, False), "qwen3_moe": (False, True)}
    assert family_of({"architectures": ["Qwen2ForCausalLM"]}).name == "qwen2"   # model_type missing
    # transformers 5 writes rope_theta and the scaling under rope_parameters
    v5 = {k: v for k, v in CONFIGS["llama-3.1-8b"].items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**_LLAMA31_ROPE, "rope_theta": 500000.0}
    s = ModelShape.from_hf_config(v5)
    assert (s.family, s.rope_theta, s.rope_scaling) == ("llama", 500000.0, Llama3Rope(8.0, 1.0, 4.0, 8192))
    assert ModelShape.from_hf_config(CONFIGS["qwen2.5-7b"]).rope_scaling is None
    # transformers 5 writes num_experts as num_local_experts
    v5 = {k: v for k, v in CONFIGS["qwen3-30b-a3b"].items() if k != "num_experts"} | {"num_local_experts": 128}
    assert ModelShape.from_hf_config(v5) == PUBLISHED["qwen3-30b-a3b"]


@pytest.mark.parametrize("change, match", [
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "model_type='mistral'"),
    ({"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"]}, "model_type='qwen2_moe'"),
    ({"model_type": None, "architectures": None}, "model_type=None"),
])
def test_an_unknown_family_is_refused_at_config_load_naming_the_supported(tmp_path, capsys, change, match):
    model = tmp_path / "Some-Model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**CONFIGS["qwen2.5-7b"], **change}))
    with pytest.raises(ConfigError) as e:
        load_config("tiny-cpu", [f"model.path={model}", "model.tiny=null"])
    for text in (match, "qwen3 (Qwen3 (dense))", "qwen2 (Qwen2 / Qwen2.5)", "llama (Llama 3.x)",
                 "qwen3_moe (Qwen3 MoE)"):
        assert text in str(e.value)
    with pytest.raises(SystemExit) as exit:
        main(["config", "validate", "tiny-cpu", f"model.path={model}", "model.tiny=null"])
    assert exit.value.code == EXIT_CONFIG and "not a model family rstar-hpc trains" in capsys.readouterr().err


@pytest.mark.parametrize("name, change, match", [
    ("qwen2.5-7b", {"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ("qwen2.5-7b", {"use_sliding_window": True}, "use_sliding_window=True"),
    ("llama-3.1-8b", {"attention_bias": True}, "attention_bias=true"),
    ("llama-3.1-8b", {"mlp_bias": True}, "mlp_bias=True"),
    ("qwen3-30b-a3b", {"mlp_only_layers": [0]}, "experts in every layer"),
    ("qwen3-30b-a3b", {"decoder_sparse_step": 2}, "experts in every layer"),
])
def test_a_variant_the_trainer_cannot_build_is_refused(name, change, match):
    with pytest.raises(ValueError, match=match):
        ModelShape.from_hf_config({**CONFIGS[name], **change})


@pytest.mark.parametrize("directory, key", [
    ("Qwen2.5-7B-Instruct", "qwen2.5-7b"), ("Qwen2.5-Math-7B", "qwen2.5-math-7b"), ("qwen2.5-32b", "qwen2.5-32b"),
    ("Llama-3.1-8B", "llama-3.1-8b"), ("Meta-Llama-3.1-70B-Instruct", "llama-3.1-70b"),
    ("Qwen3-14B-Base", "qwen3-14b"), ("Qwen2.5-72B", None), ("Llama-3.1-405B", None),
    ("Qwen3-30B-A3B-Base", "qwen3-30b-a3b"),
])
def test_a_directory_name_finds_its_published_shape(directory, key):
    assert published_shape(directory) == key


@pytest.mark.parametrize("model", ["Qwen2.5-7B-Instruct", "Llama-3.1-8B", "Qwen3-30B-A3B"])
def test_both_planners_read_the_shapes(tmp_path, model):
    path = f"model.path={tmp_path / model}"   # no config.json there: the published shape, by name
    runner = CliRunner()
    memory = runner.invoke(cli, ["train", "qwen3-14b", path, "--plan", "--json"])
    assert memory.exit_code == 0, memory.output
    assert json.loads(memory.output)["params_per_rank"] > 0
    plan = runner.invoke(cli, ["plan", "qwen3-14b", path, "--json"])
    assert plan.exit_code == 0, plan.output
    assert "gpu_hours" in plan.output
    if model == "Qwen3-30B-A3B":   # memory and syncs count all 30.5B parameters, its FLOPs the 3.3B active
        got = json.loads(plan.output)
        assert got["parameters"] == PUBLISHED["qwen3-30b-a3b"].num_params
        assert got["active_parameters"] == PUBLISHED["qwen3-30b-a3b"].active_params
        split = runner.invoke(cli, ["train", "qwen3-14b", path, "trainer.expert_parallel_size=2", "--plan", "--json"])
        assert split.exit_code == 0, split.output
        assert json.loads(split.output)["params_per_rank"] < json.loads(memory.output)["params_per_rank"]


@pytest.mark.parametrize("model, ep, match", [
    ("Qwen3-30B-A3B", 3, "does not divide the model's 128 experts"),
    ("Qwen3-30B-A3B", 16, "does not divide the data-parallel size"),
    ("Qwen2.5-7B", 2, "has no experts"),
])
def test_expert_parallelism_is_checked_against_the_experts_and_the_ranks(tmp_path, model, ep, match):
    with pytest.raises(ConfigError, match=match):
        load_config("qwen3-14b", [f"model.path={tmp_path / model}", f"trainer.expert_parallel_size={ep}"])


def test_the_tiny_model_of_a_family_has_its_own_directory_and_a_shape_vllm_reads():
    from rstar_hpc.config.run import TinyModelSpec

    dirs = {f: load_config("tiny-cpu", [f"model.tiny.family={f}"]).model_dir().name for f in FAMILIES}
    assert all(d.startswith(f"tiny-{f}-") for f, d in dirs.items()) and len(set(dirs.values())) == 4
    with pytest.raises(ValueError, match="num_heads .4. x head_dim .64. must equal hidden_size .128."):
        TinyModelSpec(family="qwen2", head_dim=64)
    with pytest.raises(ConfigError, match="family 'mistral': one of qwen3, qwen2, llama, qwen3_moe"):
        load_config("tiny-cpu", ["model.tiny.family=mistral"])
