"""Knobs that change memory and speed, not the numbers: packing vs padding, activation recompute; and bf16 with
fp32 main weights. One rank, real megatron-core (its optimizers and schedules under host_device on the CPU)."""
from __future__ import annotations

import pytest
import torch
from tests.helpers.trainer import make_optimizer, make_policy

from rstar_hpc.trainer.hf_convert import gather_hf_state
from rstar_hpc.trainer.packing import pack, pad
from rstar_hpc.trainer.step import forward_backward, train_step


def _samples(vocab: int, lengths=(5, 31, 12, 60, 8, 23)) -> list:
    gen = torch.Generator().manual_seed(3)
    out = []
    for n in lengths:
        mask = torch.rand(n, generator=gen) < 0.8
        mask[0] = False
        out.append((torch.randint(0, vocab, (n,), generator=gen), mask))
    return out


def _loss_and_grads(policy, micro_batches) -> tuple[float, dict]:
    m = forward_backward(policy, micro_batches)
    return m["loss"], gather_hf_state(policy, grads=True)


def test_packing_gives_the_loss_and_gradients_of_padding(dist1, tiny_hf_dir):
    policy = make_policy(tiny_hf_dir)
    samples = _samples(policy.arch.vocab_size)
    packed = pack(samples, 64)
    padded = pad(samples, rows_per_micro_batch=2)  # 3 micro-batches of 2 rows x 60 tokens
    assert len(packed) == 3 and sum(mb.num_slots for mb in packed) == 139  # the tokens, nothing more
    assert [mb.num_slots for mb in padded] == [120, 120, 120]
    loss_packed, grads_packed = _loss_and_grads(policy, packed)
    loss_padded, grads_padded = _loss_and_grads(policy, padded)
    assert loss_padded == pytest.approx(loss_packed, rel=1e-6)
    for name, g in grads_packed.items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(grads_padded[name], g, rtol=1e-4, atol=1e-7, msg=name)


def test_padding_packed_micro_batches_to_a_length_multiple_changes_no_number(dist1, tiny_hf_dir):
    """`trainer.packed_length_multiple` (CUDA's stable shapes) adds an untrained filler sample to each packed
    micro-batch; the loss, its gradients and the logprobs of the real tokens stay those of the unpadded batch."""
    from rstar_hpc.trainer.step import forward_logprobs

    samples = pack(_samples(400), 64)
    policy = make_policy(tiny_hf_dir)
    loss, grads = _loss_and_grads(policy, samples)
    lps = forward_logprobs(policy, samples)
    policy.length_multiple = 48
    assert {mb.num_tokens % 48 for mb in samples} != {0}   # something is padded
    loss_p, grads_p = _loss_and_grads(policy, samples)
    lps_p = forward_logprobs(policy, samples)
    assert loss_p == pytest.approx(loss, rel=1e-6)
    for a, b in zip(lps_p, lps):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(grads_p[name], g, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("knobs", [{"recompute": "selective"}, {"recompute": "selective", "recompute_modules": ["mlp"]},
                                   {"recompute": "full", "recompute_num_layers": 1}])
def test_activation_recompute_changes_no_number(dist1, tiny_hf_dir, knobs):
    samples = pack(_samples(400), 64)
    loss, grads = _loss_and_grads(make_policy(tiny_hf_dir), samples)
    policy = make_policy(tiny_hf_dir, **knobs)
    layer = policy.chunks[0].module.decoder.layers[0]
    assert policy.config.recompute_granularity == knobs["recompute"]
    assert knobs["recompute"] == "full" or layer.self_attention.checkpoint_core_attention == (
        "core_attn" in knobs.get("recompute_modules", ["core_attn"]))
    loss_r, grads_r = _loss_and_grads(policy, samples)
    assert loss_r == loss
    for name, g in grads.items():
        torch.testing.assert_close(grads_r[name], g, rtol=0, atol=1e-7, msg=name)


def test_bf16_trains_bf16_weights_from_fp32_main_weights(dist1, tiny_hf_dir):
    """An update far below bf16's resolution (lr 1e-6 on weights ~0.1: 1e-7 per step vs a bf16 ulp of ~5e-4)
    still accumulates in the fp32 main weights; the bf16 weights are the main weights rounded."""
    fp32 = make_policy(tiny_hf_dir)
    policy = make_policy(tiny_hf_dir, params_dtype="bfloat16")
    opt = make_optimizer(policy, lr=1e-6, params_dtype="bfloat16", weight_decay=0.0)
    assert all(p.dtype == torch.bfloat16 for p in policy.parameters())
    inner = opt.chained_optimizers[0]
    main = [p for g in inner.fp32_from_float16_groups for p in g]
    assert main and all(p.dtype == torch.float32 for p in main)
    before = [p.detach().clone() for p in main]
    samples = pack(_samples(400), 64)
    loss_fp32 = forward_backward(fp32, samples)["loss"]
    metrics = [train_step(policy, opt, None, samples) for _ in range(3)]
    assert metrics[0]["loss"] == pytest.approx(loss_fp32, rel=2e-2)  # bf16 matmuls, the same model
    moved = [float((p - b).abs().max()) for p, b in zip(main, before)]
    assert min(moved) > 1e-7 and max(moved) < 1e-5  # ~3 steps of lr-sized AdamW updates, kept in fp32
    model = [p for g in inner.float16_groups for p in g]
    for p, m in zip(model, main):
        assert torch.equal(p, m.to(torch.bfloat16))


BF16, DIST = {"params_dtype": "bfloat16"}, {"use_distributed_optimizer": True}


@pytest.mark.parametrize("saved,loaded", [(BF16, BF16), (DIST, DIST), ({**BF16, **DIST}, {**BF16, **DIST}),
                                          (BF16, {**BF16, **DIST})])
def test_resume_is_exact_with_bf16_and_the_distributed_optimizer(dist1, tiny_hf_dir, tmp_path, saved, loaded):
    """Saved after two steps and loaded into a fresh policy, the third step is bitwise the uninterrupted one:
    fp32 main weights and AdamW moments (sharded, for the distributed optimizer) round-trip exactly. From the plain
    bf16 optimizer into the distributed one the loss is bitwise too; the gradient norm (so the clipped update) only
    to rounding, as the two sum the norm's squares in different orders (so do they from equal fresh gradients)."""
    from rstar_hpc.trainer.checkpoint import TrainState, load_checkpoint, save_checkpoint
    from rstar_hpc.trainer.step import build_scheduler

    def state(knobs):
        policy = make_policy(tiny_hf_dir, **knobs)
        opt = make_optimizer(policy, lr=1e-3, **knobs)
        return TrainState(policy, opt, build_scheduler(opt, 1, 10, "cosine"))
    samples = pack(_samples(400), 64)
    a = state(saved)
    for _ in range(2):
        train_step(a.model, a.optimizer, a.scheduler, samples)
    a.step = 2
    save_checkpoint(a, tmp_path / "ckpt")
    b = state(loaded)
    load_checkpoint(b, tmp_path / "ckpt")
    ma = train_step(a.model, a.optimizer, a.scheduler, samples)
    mb = train_step(b.model, b.optimizer, b.scheduler, samples)
    assert ma["loss"] == mb["loss"] and ma["lr"] == mb["lr"]
    if saved == loaded:
        assert ma["grad_norm"] == mb["grad_norm"]
        for pa, pb in zip(a.model.parameters(), b.model.parameters()):
            assert torch.equal(pa, pb)
    else:   # the two optimizers sum the norm's squares in different orders: equal gradients, norms ~1e-7 apart
        assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-6)
        for pa, pb in zip(a.model.parameters(), b.model.parameters()):
            torch.testing.assert_close(pa, pb, rtol=0, atol=2 ** -8 * float(pa.abs().max()))
    main = [p for o in b.optimizer.chained_optimizers for g in o.optimizer.param_groups for p in g["params"]]
    assert all(p.dtype == torch.float32 for p in main)
