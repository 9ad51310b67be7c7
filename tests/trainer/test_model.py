"""The Megatron policy equals Hugging Face Qwen3, and conversion is exact both ways."""
from __future__ import annotations

import json

import pytest
import torch
from tests.helpers.trainer import BACKENDS
from transformers import Qwen3ForCausalLM

from rstar_hpc.trainer.hf_convert import (
    export_hf_checkpoint,
    hf_to_megatron,
    load_hf_checkpoint,
    megatron_to_hf,
    read_hf_weights,
)
from rstar_hpc.trainer.arch import Arch
from rstar_hpc.trainer.attention import SDPACoreAttention, packed_seq_params
from rstar_hpc.trainer.model import build_model, forward_logits, have_transformer_engine, layer_spec, token_logprobs
from rstar_hpc.trainer.parallel_dims import ParallelDims


@pytest.fixture(scope="module")
def hf_model(tiny_hf_dir):
    return Qwen3ForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def policy(dist1, tiny_hf_dir):
    model = build_model(Arch.from_hf_config(tiny_hf_dir))
    load_hf_checkpoint(model, tiny_hf_dir)
    return model.eval()


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request, dist1, tiny_hf_dir, hf_model, policy):
    """(Hugging Face model, policy, tolerance) on the backend's device, fp32 both. On CUDA the two run different
    GEMM shapes (fused QKV, vocabulary padding), so sums are ordered differently: a looser tolerance."""
    if request.param == "cpu":
        yield hf_model, policy, 1e-5
        return
    model = build_model(Arch.from_hf_config(tiny_hf_dir), backend="cuda")
    load_hf_checkpoint(model, tiny_hf_dir)
    yield Qwen3ForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32).cuda().eval(), model.eval(), 1e-4


def test_logits_match_hugging_face(pair):
    hf_model, policy, tol = pair
    device = next(policy.parameters()).device
    ids = torch.randint(0, policy.arch.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        ref = hf_model(ids).logits
        got = forward_logits(policy, ids)[..., : policy.arch.vocab_size]
    assert ref.abs().max() > 1.0  # the perturbed model is far from uniform: a wrong mapping would show
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    lp = token_logprobs(forward_logits(policy, ids), ids, policy.arch.vocab_size)
    torch.testing.assert_close(lp, torch.log_softmax(ref, -1).gather(-1, ids[..., None])[..., 0],
                               rtol=tol, atol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_varlen_attention_equals_per_sample_attention_in_bf16(monkeypatch):
    """On CUDA in bf16 a packed micro-batch takes one flash varlen call per layer. Against one causal SDPA call per
    sample in fp32, its values and gradients (grouped-query heads: 8 query, 2 key/value heads of 128) are as close
    as the per-sample calls' own in bf16: bf16 rounding, which differs element by element between two kernels."""
    from types import SimpleNamespace

    from rstar_hpc.trainer import attention

    if attention.varlen_attn is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    lens = [300, 1, 517, 64, 1100]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lens), h, 128, generator=gen).cuda() for h in (8, 2, 2))
    attn = SimpleNamespace(num_heads=8, num_groups=2, softmax_scale=128 ** -0.5)
    packed = packed_seq_params(lens, "cuda")

    def run(dtype):
        x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = SDPACoreAttention._packed(attn, *x, packed, causal=True, dropout=0.0)
        out.float().pow(2).sum().backward()
        return [out.float()] + [t.grad.float() for t in x]
    varlen = run(torch.bfloat16)
    monkeypatch.setattr(attention, "varlen_attn", None)   # the per-sample loop
    loop, exact = run(torch.bfloat16), run(torch.float32)
    assert varlen[0].shape == (sum(lens), 8 * 128)
    for name, a, b, ref in zip(("out", "dq", "dk", "dv"), varlen, loop, exact):
        assert ref.abs().max() > 0, name
        err, err_loop = (a - ref).abs(), (b - ref).abs()
        assert err.max() <= 2 * err_loop.max() + 1e-3 and err.mean() <= 2 * err_loop.mean() + 1e-5, \
            (name, err.max().item(), err_loop.max().item(), err.mean().item(), err_loop.mean().item())


def test_packed_sequences_equal_separate_ones(pair):
    hf_model, policy, tol = pair
    device = next(policy.parameters()).device
    lens = [7, 20, 13]
    seqs = [torch.randint(0, policy.arch.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).to(device)
            for n in lens]
    with torch.no_grad():
        packed = forward_logits(policy, torch.cat(seqs)[None], packed_seq_params(lens, device))
        for seq, part in zip(seqs, packed[0, :, :policy.arch.vocab_size].split(lens)):
            torch.testing.assert_close(part, hf_model(seq[None]).logits[0], rtol=tol, atol=tol)


def test_export_reload_is_identical(policy, tiny_hf_dir, tmp_path, hf_model):
    out = export_hf_checkpoint(policy, tmp_path / "export", source_dir=tiny_hf_dir, max_shard_bytes=200_000)
    assert (out / "model.safetensors.index.json").is_file()  # small shards: the sharded path is exercised
    assert (out / "tokenizer.json").is_file()
    orig, back = read_hf_weights(tiny_hf_dir), read_hf_weights(out)
    assert orig.keys() == back.keys()
    for k in orig:
        assert torch.equal(orig[k], back[k]), k
    assert json.loads((out / "config.json").read_text())["vocab_size"] == policy.arch.vocab_size
    reloaded = Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.arange(30)[None] % policy.arch.vocab_size
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf_model(ids).logits)


@pytest.mark.parametrize("tp", [1, 2])
def test_tensor_parallel_shards_reassemble(tiny_hf_dir, tp):
    """hf -> per-rank shards -> hf is the identity, with vocabulary padding and whole query groups per rank."""
    arch = Arch.from_hf_config(tiny_hf_dir)
    if arch.num_kv_heads % tp:
        pytest.skip("kv heads not divisible")
    hf = read_hf_weights(tiny_hf_dir)
    names = {"output_layer.weight", "embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}
    shards = [hf_to_megatron(hf, arch, tp, r, names) for r in range(tp)]
    assert shards[0]["embedding.word_embeddings.weight"].size(0) * tp == arch.padded_vocab_size(tp)
    back = megatron_to_hf(shards, arch)
    for k in hf:
        assert torch.equal(hf[k], back[k]), k


def test_qkv_layout_is_grouped(tiny_hf_dir):
    """Rank 0 of tp=2 holds query group 0: its query heads, then its key head, then its value head."""
    arch = Arch.from_hf_config(tiny_hf_dir)
    hf = read_hf_weights(tiny_hf_dir)
    qkv = hf_to_megatron(hf, arch, 2, 0, set())["decoder.layers.0.self_attention.linear_qkv.weight"]
    per, hd = arch.num_heads // arch.num_kv_heads, arch.head_dim
    p = "model.layers.0.self_attn."
    assert torch.equal(qkv[: per * hd], hf[p + "q_proj.weight"][: per * hd])
    assert torch.equal(qkv[per * hd: (per + 1) * hd], hf[p + "k_proj.weight"][:hd])
    assert torch.equal(qkv[(per + 1) * hd:], hf[p + "v_proj.weight"][:hd])


def test_bad_inputs_name_the_problem(dist1, tiny_hf_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        Arch.from_hf_config(tmp_path)
    cfg = json.loads((tiny_hf_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral", "architectures": ["Mistral"]}))
    with pytest.raises(ValueError, match="supported: qwen3"):
        Arch.from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    model = build_model(Arch.from_hf_config(tiny_hf_dir))
    with pytest.raises(ValueError, match="num_layers"):
        load_hf_checkpoint(model, tmp_path)
    with pytest.raises(ValueError, match="WORLD_SIZE=3"):
        ParallelDims(world_size=3, tp=2)
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tensor_parallel_size=4"):
        ParallelDims(world_size=4, tp=4).check_model(Arch(vocab_size=10, hidden_size=8, intermediate_size=8,
                                                               num_layers=1, num_heads=4, num_kv_heads=2, head_dim=2))


def test_cuda_without_transformer_engine_takes_the_local_spec_and_says_so_once(caplog):
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here")
    have_transformer_engine.cache_clear()
    with caplog.at_level("WARNING", logger="rstar_hpc.trainer.model"):
        specs = [layer_spec("cuda"), layer_spec("cuda")]
    assert all(s.submodules.self_attention.submodules.core_attention is SDPACoreAttention for s in specs)
    assert sum("Transformer Engine not found" in r.getMessage() for r in caplog.records) == 1
