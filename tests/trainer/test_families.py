"""Qwen2, Llama 3 and Qwen3 MoE through the trainer as Qwen3 goes: Hugging Face logits == Megatron logits (fp32) at
tensor parallel 1 and 2, conversion exact both ways, and load -> one optimizer step -> export giving an HF model of
the family whose logits are the trained policy's (Qwen3 MoE: its load-balancing loss trained and logged too)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.helpers import family_worker
from tests.helpers.trainer import BACKENDS, free_port
from transformers import AutoModelForCausalLM

from rstar_hpc.trainer.arch import Arch
from rstar_hpc.trainer.attention import packed_seq_params
from rstar_hpc.trainer.hf_convert import hf_to_megatron, load_hf_checkpoint, megatron_to_hf, read_hf_weights
from rstar_hpc.trainer.model import build_model, forward_logits

WORKER = Path(family_worker.__file__)
TOL = {"rtol": 1e-5, "atol": 1e-5}
HF_CLASS = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _hf(hf_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def _megatron(arch: Arch, hf_dir, backend: str = "cpu"):
    model = build_model(arch, backend=backend)
    load_hf_checkpoint(model, hf_dir)
    return model.eval()


def test_the_families_are_what_they_say(family_hf_dir):
    arch = Arch.from_hf_config(family_hf_dir)
    hf = read_hf_weights(family_hf_dir)
    assert type(_hf(family_hf_dir)).__name__ == HF_CLASS[arch.family]
    assert ("model.layers.0.self_attn.q_proj.bias" in hf) == arch.qkv_bias == (arch.family == "qwen2")
    assert any("q_norm" in k for k in hf) == arch.qk_norm == arch.is_moe == (arch.family == "qwen3_moe")
    assert sum(".mlp.experts." in k for k in hf) == 2 * 3 * arch.num_experts   # 4 experts: all converted
    assert arch.tie_word_embeddings == ("lm_head.weight" not in hf) == (arch.family == "qwen2")
    assert (arch.rope_scaling is not None) == (arch.family == "llama")


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_match_hugging_face_packed_too(dist1, family_hf_dir, backend):
    """On CUDA the two run different GEMM shapes (fused QKV, vocabulary padding): test_model.py's looser tolerance.
    The Llama model built without its RoPE scaling gives other logits: the scaling is exercised, by both backends'
    RoPE (attention.CPURotaryEmbedding, megatron-core's RotaryEmbedding)."""
    device, tol = ("cpu", TOL) if backend == "cpu" else ("cuda", {"rtol": 1e-4, "atol": 1e-4})
    arch = Arch.from_hf_config(family_hf_dir)
    hf_model, policy = _hf(family_hf_dir).to(device), _megatron(arch, family_hf_dir, backend)
    tokens = family_worker.ids(arch.vocab_size).to(device)
    lens = [7, 20, 13]
    with torch.no_grad():
        ref = hf_model(tokens).logits
        torch.testing.assert_close(forward_logits(policy, tokens)[..., : arch.vocab_size], ref, **tol)
        packed = forward_logits(policy, tokens[0][None], packed_seq_params(lens, device))[0, :, : arch.vocab_size]
        for seq, part in zip(tokens[0].split(lens), packed.split(lens)):   # RoPE restarts per sample
            torch.testing.assert_close(part, hf_model(seq[None]).logits[0], **tol)
    assert ref.abs().max() > 1.0   # the perturbed model is far from uniform: a wrong mapping would show
    if arch.rope_scaling is not None:
        plain = build_model(dataclasses.replace(arch, rope_scaling=None), backend=backend).eval()
        plain.load_state_dict(policy.state_dict())
        with torch.no_grad():
            assert not torch.allclose(forward_logits(plain, tokens)[..., : arch.vocab_size], ref, **tol)


def test_tensor_parallel_shards_reassemble_with_the_biases_grouped(family_hf_dir):
    """hf -> tp 2 shards -> hf is the identity; rank 0 holds query group 0: its query heads, key and value head, in
    the fused weight and (Qwen2) the fused bias alike."""
    arch = Arch.from_hf_config(family_hf_dir)
    hf = read_hf_weights(family_hf_dir)
    names = {"output_layer.weight", "embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}
    shards = [hf_to_megatron(hf, arch, 2, r, names) for r in range(2)]
    if arch.tie_word_embeddings:   # the tied HF embedding also feeds megatron's output layer (a later stage's)
        assert torch.equal(shards[0]["output_layer.weight"], shards[0]["embedding.word_embeddings.weight"])
    back = megatron_to_hf(shards, arch)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(hf[k], back[k]), k
    per, hd = arch.num_heads // arch.num_kv_heads, arch.head_dim
    p, m = "model.layers.0.self_attn.", "decoder.layers.0.self_attention.linear_qkv."
    for suffix in ("weight", "bias") if arch.qkv_bias else ("weight",):
        fused = shards[0][m + suffix]
        assert torch.equal(fused[: per * hd], hf[p + "q_proj." + suffix][: per * hd])
        assert torch.equal(fused[per * hd: (per + 1) * hd], hf[p + "k_proj." + suffix][:hd])
        assert torch.equal(fused[(per + 1) * hd:], hf[p + "v_proj." + suffix][:hd])
    if arch.is_moe:   # rank 1's expert 3: the second halves of its gate and up rows, then of its down columns
        half, x = arch.moe_intermediate_size // 2, "model.layers.0.mlp.experts.3."
        e = "decoder.layers.0.mlp.experts.local_experts.3."
        assert torch.equal(shards[1][e + "linear_fc1.weight"], torch.cat([hf[x + "gate_proj.weight"][half:],
                                                                          hf[x + "up_proj.weight"][half:]]))
        assert torch.equal(shards[1][e + "linear_fc2.weight"], hf[x + "down_proj.weight"][:, half:])
        assert torch.equal(shards[1]["decoder.layers.0.mlp.router.weight"], hf["model.layers.0.mlp.gate.weight"])


def _check_run(result: dict, hf_dir: Path, export: Path) -> None:
    """The logits before training are Hugging Face's of `hf_dir`, the trained policy's are the export's."""
    tokens = family_worker.ids(Arch.from_hf_config(hf_dir).vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(result["before"], _hf(hf_dir)(tokens).logits, **TOL)
        exported = _hf(export)
        torch.testing.assert_close(result["after"], exported(tokens).logits, **TOL)
    assert not torch.allclose(result["after"], result["before"], **TOL)   # the step moved the weights
    source, config = json.loads((hf_dir / "config.json").read_text()), json.loads((export / "config.json").read_text())
    assert type(exported).__name__ == HF_CLASS[config["model_type"]]
    assert (config["model_type"], config["architectures"]) == (source["model_type"], source["architectures"])
    assert read_hf_weights(export).keys() == read_hf_weights(hf_dir).keys()
    # the router's load-balancing loss: trained (megatron's aux loss) and logged; near 1 when balanced
    assert (0.5 < result["load_balancing_loss"] < 4.0) if "qwen3_moe" == config["model_type"] else \
        result["load_balancing_loss"] is None


def test_load_train_export_at_tp1(dist1, family_hf_dir, tmp_path):
    _check_run(family_worker.run(str(family_hf_dir), str(tmp_path)), family_hf_dir, tmp_path / "export")


def _spawn(world: int, *argv: str) -> None:
    """`python argv...` as a gloo world of `world` ranks."""
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, *argv], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(world)]
    logs = [p.communicate(timeout=240)[0].decode()[-3000:] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)


def test_load_train_export_at_tp2(family_hf_dir, tmp_path):
    _spawn(2, str(WORKER), str(family_hf_dir), str(tmp_path))
    _check_run(torch.load(tmp_path / "logits.pt"), family_hf_dir, tmp_path / "export")


@pytest.mark.parametrize("family_hf_dir", ["qwen3_moe"], indirect=True)
def test_two_expert_parallel_ranks_train_and_export_as_one(dist1, family_hf_dir, tmp_path):
    """trainer.expert_parallel_size 2 on gloo (its all-to-all): each of 2 data-parallel ranks holds 2 of the 4 experts,
    loaded from their HF tensors; both train the same batch, so the step is the single rank's (the experts' gradients
    reduced over their own data-parallel group, not the whole one), and the export gathers every expert."""
    one = family_worker.run(str(family_hf_dir), str(tmp_path / "one"))
    _spawn(2, str(WORKER), str(family_hf_dir), str(tmp_path), "2")
    got = torch.load(tmp_path / "logits.pt")
    _check_run(got, family_hf_dir, tmp_path / "export")
    assert (got["loss"], got["load_balancing_loss"]) == pytest.approx((one["loss"], one["load_balancing_loss"]))
    torch.testing.assert_close(got["after"], one["after"], rtol=1e-4, atol=1e-4)   # Adam on another reduction order


def test_two_pipeline_stages_train_and_export_as_one_rank(dist1, family4_hf_dir, tmp_path):
    """Qwen2's tied embedding is on both stages (megatron's output layer on the last, kept equal)."""
    from tests.helpers import pp_worker

    ref = pp_worker.run(str(family4_hf_dir), {})
    spec = tmp_path / "layout.json"
    spec.write_text(json.dumps({"pp": 2, "export": str(tmp_path / "hf")}))
    _spawn(2, str(Path(pp_worker.__file__)), str(family4_hf_dir), str(tmp_path / "pp2.pt"), str(spec))
    got = torch.load(tmp_path / "pp2.pt")
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert got["grads"].keys() == ref["grads"].keys() == read_hf_weights(family4_hf_dir).keys()
    for name, g in ref["grads"].items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-4, abs=1e-5)
    for k, w in ref["weights"].items():
        # Adam moves elements of ~1e-8 gradients by ~1e-4 under another summation order (test_pipeline.py), and
        # Qwen2's key bias (64 numbers) has many: a wrongly updated tensor is off by ~lr (1e-2) everywhere
        d = (got["weights"][k] - w).abs()
        assert float(d.max()) < 1e-3 and float(d.mean()) < 1e-4, (k, float(d.max()), float(d.mean()))
    exported = read_hf_weights(got["exported"])
    assert exported.keys() == got["weights"].keys() and all(torch.equal(exported[k], w) for k, w in got["weights"].items())


@pytest.mark.vllm
def test_vllm_serves_the_export_with_the_trained_policys_logprobs(dist1, family_hf_dir, tmp_path):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rstar_hpc.config import load_config
    from rstar_hpc.rollout.engine_args import vllm_engine_kwargs

    trained = family_worker.run(str(family_hf_dir), str(tmp_path))
    llm = LLM(**vllm_engine_kwargs(load_config("tiny-cpu").rollout.engine, tmp_path / "export", seed=0))
    try:
        tokens = family_worker.ids(Arch.from_hf_config(family_hf_dir).vocab_size)[0].tolist()
        out = llm.generate(TokensPrompt(prompt_token_ids=tokens),
                           SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=0),
                           use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
        lp = torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], tokens[1:])])
        ref = torch.log_softmax(trained["after"][0, :-1], -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
        torch.testing.assert_close(lp, ref, atol=2e-3, rtol=0)
    finally:
        del llm
