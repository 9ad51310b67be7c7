"""Group advantages and the policy loss: hand-computed values and a naive per-token reference."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rstar_hpc.algo import entropy_from_logits, group_advantages, policy_loss, tokens_per_sample
from rstar_hpc.config.algo import LossConfig


@pytest.fixture(autouse=True)
def float64():
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # exact comparisons against the naive reference
    yield
    torch.set_default_dtype(prev)


# --------------------------------------------------------------------------------------------------
# advantages


def test_group_advantages_hand_computed():
    # group a: [1, 0, 0, 0] -> mean 0.25, unbiased std sqrt(0.75 / 3) = 0.5
    adv = group_advantages([1, 0, 7, 0, 0, 1, 1], ["a", "a", "s", "a", "a", "b", "b"])
    assert adv[[0, 1, 3, 4]] == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-5)
    assert adv[2] == 0.0                     # a group of one: no baseline, no signal
    assert adv[[5, 6]].tolist() == [0.0, 0.0]  # all equal: std 0, advantage 0 (not NaN)
    raw = group_advantages([1, 0, 0, 0], [0] * 4, norm_adv_by_std=False)
    assert raw.tolist() == [0.75, -0.25, -0.25, -0.25]


def test_group_advantages_match_verl_formula():
    rng = np.random.default_rng(0)
    r = rng.integers(0, 2, 64).astype(float)
    ids = rng.integers(0, 5, 64)
    adv = group_advantages(r, ids)
    for g in np.unique(ids):
        t = torch.tensor(r[ids == g])
        assert adv[ids == g] == pytest.approx(((t - t.mean()) / (t.std() + 1e-6)).numpy())


def test_tokens_per_sample():
    assert tokens_per_sample([1.0, -2.0, 3.0], [2, 1, 3]).tolist() == [1, 1, -2, 3, 3, 3]
    with pytest.raises(ValueError, match="equal length"):
        tokens_per_sample([1.0], [1, 2])


# --------------------------------------------------------------------------------------------------
# loss: hand-computed single tokens


@pytest.mark.parametrize("adv, ratio, dual_c, loss, has_grad", [
    (1.0, 1.5, None, -1.28, False),   # A > 0 above 1 + 0.28: clipped (Clip-Higher)
    (1.0, 1.2, None, -1.2, True),     # inside the wider upper bound
    (1.0, 0.5, None, -0.5, True),     # A > 0 below 1 - 0.2: not clipped (min of surrogates)
    (-1.0, 0.5, None, 0.8, False),    # A < 0 below 1 - 0.2: clipped
    (-1.0, 1.5, None, 1.5, True),     # A < 0 above: not clipped
    (-1.0, 5.0, None, 5.0, True),
    (-1.0, 5.0, 3.0, 3.0, False),     # dual-clip caps it at -A * c
    (-1.0, 2.0, 3.0, 2.0, True),
])
def test_single_token(adv, ratio, dual_c, loss, has_grad):
    lp = torch.tensor([math.log(ratio)], requires_grad=True)
    out, stats = policy_loss(lp, torch.zeros(1), torch.tensor([adv]), torch.ones(1), global_num_tokens=1,
                             clip_ratio_c=dual_c)
    assert out.item() == pytest.approx(loss)
    out.backward()
    assert (lp.grad.abs().item() > 0) == has_grad
    assert stats["clip_high_count"] == float(adv > 0 and ratio > 1.28)
    assert stats["clip_low_count"] == float(adv < 0 and ratio < 0.8)
    assert stats["clip_dual_count"] == float(dual_c is not None and not has_grad and ratio > dual_c)


def test_importance_weights_scale_each_tokens_loss_and_gradient():
    """Off-policy steps (trainer/rl.py): a token's clipped surrogate times its truncated IS weight, no gradient
    through the weight; masked tokens ignore theirs (even garbage)."""
    lp = torch.tensor([-1.0, -0.5, -2.0], requires_grad=True)
    old, adv, mask = torch.tensor([-1.0, -0.5, -2.0]), torch.tensor([1.0, -1.0, 1.0]), torch.tensor([1, 1, 0])
    plain, _ = policy_loss(lp, old, adv, mask, global_num_tokens=2)
    (g_plain,) = torch.autograd.grad(plain, lp)
    w = torch.tensor([2.0, 0.5, float("nan")], requires_grad=True)
    weighted, _ = policy_loss(lp, old, adv, mask, global_num_tokens=2, is_weight=w)
    (g,) = torch.autograd.grad(weighted, lp)
    assert weighted.item() == pytest.approx((-1.0 * 2.0 + 1.0 * 0.5) / 2)   # ratio 1: l_t = -A_t, times w_t
    assert g[0].item() == pytest.approx(2.0 * g_plain[0].item()) and g[1].item() == pytest.approx(0.5 * g_plain[1].item())
    assert g[2].item() == 0.0 and torch.isfinite(g).all()
    ones, _ = policy_loss(lp, old, adv, mask, global_num_tokens=2, is_weight=torch.ones(3))
    assert ones.item() == pytest.approx(plain.item())
    with pytest.raises(ValueError, match="is_weight has shape"):
        policy_loss(lp, old, adv, mask, global_num_tokens=2, is_weight=torch.ones(2))


def test_log_ratio_is_clamped():
    out, _ = policy_loss(torch.tensor([100.0]), torch.tensor([0.0]), torch.tensor([-1.0]), torch.ones(1),
                         global_num_tokens=1, log_ratio_clamp=20.0)
    assert out.item() == pytest.approx(math.exp(20.0))


def test_masked_garbage_gives_no_nan_and_no_gradient():
    lp = torch.tensor([-1.0, -math.inf, float("nan"), -0.5], requires_grad=True)
    out, stats = policy_loss(lp, torch.tensor([-1.1, 0.0, 0.0, -0.4]), torch.tensor([1.0, 1.0, 1.0, -1.0]),
                             torch.tensor([1, 0, 0, 1]), global_num_tokens=2)
    out.backward()
    assert torch.isfinite(out) and torch.isfinite(lp.grad).all()
    assert lp.grad[1].item() == 0.0 and lp.grad[2].item() == 0.0
    assert stats["num_tokens"] == 2


def test_kl_and_entropy_terms():
    lp, ref, ent = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]), torch.tensor([0.7, 1.1])
    kw = dict(global_num_tokens=2)
    base, _ = policy_loss(lp, lp, torch.zeros(2), torch.ones(2), **kw)
    assert base.item() == 0.0  # off by default: ref and entropy are not needed
    with_kl, st_kl = policy_loss(lp, lp, torch.zeros(2), torch.ones(2), kl_coef=0.1, ref_logprobs=ref, **kw)
    k3 = [math.exp(r - lq) - (r - lq) - 1 for lq, r in ((-1.0, -1.5), (-2.0, -1.0))]
    assert with_kl.item() == pytest.approx(0.1 * sum(k3) / 2)
    assert st_kl["kl_sum"] == pytest.approx(sum(k3))
    with_ent, _ = policy_loss(lp, lp, torch.zeros(2), torch.ones(2), entropy_coef=0.01, entropy=ent, **kw)
    assert with_ent.item() == pytest.approx(-0.01 * 1.8 / 2)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(lp, lp, torch.zeros(2), torch.ones(2), kl_coef=0.1, **kw)
    with pytest.raises(ValueError, match="entropy_from_logits"):
        policy_loss(lp, lp, torch.zeros(2), torch.ones(2), entropy_coef=0.1, **kw)
    logits = torch.zeros(3, 4)
    assert entropy_from_logits(logits) == pytest.approx(torch.full((3,), math.log(4)))


def test_bad_input():
    with pytest.raises(ValueError, match="global_num_tokens must be > 0"):
        policy_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.ones(2), global_num_tokens=0)
    with pytest.raises(ValueError, match="loss_mask has shape"):
        policy_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.ones(3), global_num_tokens=2)


# --------------------------------------------------------------------------------------------------
# loss: against a naive per-token reference, over random packed batches and micro-batch splits


def naive_loss(lp, old, adv_per_sample, sample_of_token, mask, cfg: LossConfig, ref, ent):
    """The formula written token by token, as in the paper's Eq. 6 with the global 1 / sum|o_i|."""
    terms, n = [], 0
    for t in range(lp.shape[0]):
        if not mask[t]:
            continue
        n += 1
        a = float(adv_per_sample[sample_of_token[t]])
        r = torch.exp(torch.clamp(lp[t] - old[t], -cfg.log_ratio_clamp, cfg.log_ratio_clamp))
        rc = torch.clamp(r, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
        term = torch.maximum(-a * r, -a * rc)
        if cfg.clip_ratio_c is not None and a < 0:
            term = torch.minimum(term, torch.tensor(-a * cfg.clip_ratio_c))
        d = ref[t] - lp[t]
        term = term + cfg.kl_coef * torch.clamp(torch.exp(d) - d - 1, -10, 10) - cfg.entropy_coef * ent[t]
        terms.append(term)
    return torch.stack(terms).sum() / n


@st.composite
def packed_batches(draw):
    seqlens = draw(st.lists(st.integers(1, 12), min_size=1, max_size=10))
    n_mb = draw(st.integers(1, len(seqlens)))
    cuts = sorted(draw(st.lists(st.integers(1, len(seqlens) - 1), min_size=n_mb - 1, max_size=n_mb - 1,
                                unique=True))) if len(seqlens) > 1 else []
    cfg = LossConfig(clip_ratio_c=draw(st.sampled_from([None, 3.0])), kl_coef=draw(st.sampled_from([0.0, 0.05])),
                     entropy_coef=draw(st.sampled_from([0.0, 0.01])),
                     clip_ratio_high=draw(st.sampled_from([0.2, 0.28])))
    return seqlens, cuts, cfg, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(packed_batches())
def test_micro_batched_loss_equals_naive_global_token_mean(batch):
    seqlens, cuts, cfg, seed = batch
    g = torch.Generator().manual_seed(seed)
    T, B = sum(seqlens), len(seqlens)
    lp = (-torch.rand(T, generator=g) * 3).requires_grad_()
    old = lp.detach() + torch.randn(T, generator=g) * 0.6  # ratios well outside the clip range too
    ref, ent = lp.detach() + torch.randn(T, generator=g) * 0.3, torch.rand(T, generator=g)
    adv = torch.randn(B, generator=g)
    mask = torch.rand(T, generator=g) < 0.7
    mask[0] = True
    sample_of_token = torch.repeat_interleave(torch.arange(B), torch.tensor(seqlens))

    expected = naive_loss(lp, old, adv, sample_of_token, mask, cfg, ref, ent)
    (expected_grad,) = torch.autograd.grad(expected, lp)

    # micro-batches are contiguous runs of whole samples, as the trainer packs them
    bounds = [0, *np.cumsum(seqlens)[[c - 1 for c in cuts]].tolist(), T]
    adv_tok = tokens_per_sample(adv, seqlens)
    total, n_global = torch.zeros(()), int(mask.sum())
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        s = slice(lo, hi)
        loss, _ = policy_loss(lp[s], old[s], adv_tok[s], mask[s], cfg, global_num_tokens=n_global,
                              ref_logprobs=ref[s], entropy=ent[s])
        total = total + loss
    (grad,) = torch.autograd.grad(total, lp)
    assert total.item() == pytest.approx(expected.item(), rel=1e-9, abs=1e-12)
    assert torch.allclose(grad, expected_grad, rtol=1e-9, atol=1e-12)


def test_padded_batch_equals_packed_stream():
    g = torch.Generator().manual_seed(1)
    seqlens = [5, 2, 7]
    T = sum(seqlens)
    lp, old = -torch.rand(T, generator=g), -torch.rand(T, generator=g)
    mask, adv = torch.rand(T, generator=g) < 0.8, torch.randn(3, generator=g)
    packed, _ = policy_loss(lp, old, tokens_per_sample(adv, seqlens), mask, global_num_tokens=int(mask.sum()))
    P = torch.zeros(3, 7)
    lpp, oldp, maskp = P.clone(), P.clone(), P.clone().bool()
    for i, (lo, n) in enumerate(zip([0, 5, 7], seqlens)):
        lpp[i, :n], oldp[i, :n], maskp[i, :n] = lp[lo:lo + n], old[lo:lo + n], mask[lo:lo + n]
    lpp[~maskp] = float("nan")  # padding garbage
    padded, _ = policy_loss(lpp, oldp, adv[:, None], maskp, global_num_tokens=int(mask.sum()))
    assert padded.item() == pytest.approx(packed.item(), rel=1e-12)


def test_data_parallel_ranks_average_to_the_global_mean():
    g = torch.Generator().manual_seed(2)
    T = 40
    lp = (-torch.rand(T, generator=g)).requires_grad_()
    old, adv = -torch.rand(T, generator=g), torch.randn(T, generator=g)
    mask = torch.rand(T, generator=g) < 0.5
    n = int(mask.sum())
    (ref_grad,) = torch.autograd.grad(policy_loss(lp, old, adv, mask, global_num_tokens=n)[0], lp)
    # two ranks with uneven token counts, backend averages gradients over ranks (DDP/FSDP)
    rank_grads = [torch.autograd.grad(policy_loss(lp[s], old[s], adv[s], mask[s], global_num_tokens=n,
                                                  dp_world_size=2)[0], lp)[0] for s in (slice(0, 9), slice(9, T))]
    assert torch.allclose((rank_grads[0] + rank_grads[1]) / 2, ref_grad, atol=1e-12)
    summed, _ = policy_loss(lp, old, adv, mask, global_num_tokens=None)
    assert summed.item() == pytest.approx(policy_loss(lp, old, adv, mask, global_num_tokens=n)[0].item() * n)


def test_loss_statistics_stay_on_the_device_until_read():
    """The statistics are 0-dim tensors a trainer adds up over micro-batches and reads once a step."""
    lp = torch.tensor([-1.0, -2.0, -0.5])
    _, stats = policy_loss(lp, lp - 0.1, torch.tensor([1.0, -1.0, 1.0]), torch.tensor([1, 1, 0]),
                           global_num_tokens=None)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in stats.values())
    assert float(stats["num_tokens"]) == 2.0
