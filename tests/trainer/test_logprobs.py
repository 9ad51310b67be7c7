"""Chunked log-probabilities and the fused chunked loss (trainer/logprobs.py) equal the full-logits path they
replace (tests/helpers/logprobs_ref.py): values, loss statistics and the gradients of the hidden states and of the
output weight, in fp32 within 1e-5, at tensor parallel 1 (this process) and 2 (two gloo processes), both layouts,
a vocabulary with a padding row."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.helpers.logprobs_ref import VOCAB, case, reference_aligned, reference_entropy, rl_loss
from tests.helpers.trainer import BACKENDS, free_port

from rstar_hpc.trainer.logprobs import aligned_logprobs, fused_loss

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "logprobs_tp_worker.py"
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _reference(padded: bool, loss_fn=rl_loss) -> dict:
    return _reference_of(*case(padded), loss_fn)


def _reference_of(hidden, weight, mb, loss_fn=rl_loss) -> dict:
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp = reference_aligned(h, w, mb, VOCAB)
    loss, metrics = loss_fn(lp, mb, reference_entropy(hidden, weight, mb, VOCAB))
    loss.backward()
    return {"lp": lp.detach(), "loss": loss.detach(), "metrics": metrics, "hidden_grad": h.grad,
            "weight_grad": w.grad}


def _same(got: dict, ref: dict) -> None:
    torch.testing.assert_close(got["lp"], ref["lp"], **TOL)
    torch.testing.assert_close(got["loss"], ref["loss"], **TOL)
    assert got["metrics"].keys() == ref["metrics"].keys()
    for k, v in ref["metrics"].items():
        assert abs(float(got["metrics"][k]) - float(v)) <= 1e-5 * max(1.0, abs(float(v))), k
    assert ref["hidden_grad"].abs().sum() > 0 and ref["weight_grad"][:VOCAB].abs().sum() > 0
    assert "entropy_sum" not in ref["metrics"] or ref["metrics"]["entropy_sum"] > 1.0   # the entropy is checked
    torch.testing.assert_close(got["hidden_grad"], ref["hidden_grad"], **TOL)
    torch.testing.assert_close(got["weight_grad"], ref["weight_grad"], **TOL)


@pytest.mark.parametrize("padded", [False, True], ids=["packed", "padded"])
@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_chunked_equals_full_logits_at_tp1(dist1, padded, chunk):
    hidden, weight, mb = case(padded)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, metrics = fused_loss(h, w, mb, VOCAB, rl_loss, chunk)
    loss.backward()
    got = {"lp": aligned_logprobs(hidden, weight, mb, VOCAB, chunk), "loss": loss.detach(), "metrics": metrics,
           "hidden_grad": h.grad, "weight_grad": w.grad}
    _same(got, _reference(padded))
    assert w.grad[VOCAB:].abs().sum() == 0   # padding rows: never computed, no gradient


def test_the_sft_loss_through_the_chunks(dist1):
    from rstar_hpc.trainer.step import sft_loss

    hidden, weight, mb = case()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, metrics = fused_loss(h, w, mb, VOCAB, sft_loss, 3)
    loss.backward()
    ref = _reference(False, sft_loss)
    torch.testing.assert_close(loss.detach(), ref["loss"], **TOL)
    for k in ("nll_sum", "train/entropy"):
        assert abs(float(metrics[k]) - float(ref["metrics"][k])) < 1e-4, k
    torch.testing.assert_close(h.grad, ref["hidden_grad"], **TOL)
    torch.testing.assert_close(w.grad, ref["weight_grad"], **TOL)


def test_chunked_equals_full_logits_at_tp2(dist1, tmp_path):
    out = tmp_path / "tp2.pt"
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(out)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    logs = [p.communicate(timeout=240)[0].decode()[-3000:] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    tp2 = torch.load(out)
    for padded in (False, True):
        _same(tp2[padded], _reference(padded))


def test_cpu_logits_of_a_large_vocabulary_go_in_blocks_with_the_same_numbers(monkeypatch):
    """The chunk's logits GEMM runs in vocabulary blocks on the CPU when its output outgrows the cache (a
    14B-sized vocabulary); a small one stays one call. Same values either way."""
    from rstar_hpc.trainer import logprobs

    calls = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a, **k: calls.append(a[0].shape) or mm(*a, **k))
    gen = torch.Generator().manual_seed(0)
    for rows, tokens, blocked in ((9001, 300, True), (512, 300, False)):
        w, h = torch.randn(rows, 64, generator=gen), torch.randn(tokens, 64, generator=gen)
        calls.clear()
        torch.testing.assert_close(logprobs._logits(w, h), w @ h.t(), **TOL)
        assert (len(calls) > 1 and sum(s[0] for s in calls) == rows) if blocked else not calls, calls


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bf16_weight_gradient_goes_into_the_fp32_main_grad(dist1, backend):
    """A weight with megatron's gradient buffer (DDP's `main_grad`, fp32) gets its gradient added there chunk by
    chunk, and none through autograd (no weight-sized gradient besides the buffer). In bf16, against the fp32
    reference on the same bf16-rounded numbers: within 1e-2 of the gradient's largest element (2.8e-3 measured on
    the CPU: bf16 logits; the chunks accumulate in fp32)."""
    hidden, weight, mb = case()
    hidden, weight = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)
    ref = _reference_of(hidden.float(), weight.float(), mb)
    h, w = hidden.to(backend).requires_grad_(), weight.to(backend).requires_grad_()
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=backend)
    loss, _ = fused_loss(h, w, mb.to(backend), VOCAB, rl_loss, 5)
    loss.backward()
    assert w.grad is None and w.main_grad[VOCAB:].abs().sum() == 0   # padding rows: never computed
    for got, want in ((w.main_grad, ref["weight_grad"]), (h.grad, ref["hidden_grad"])):
        err = float((got.float().cpu() - want).abs().max() / want.abs().max())
        assert err < 1e-2, err


def test_the_trainers_gradients_equal_hugging_faces(dist1, tiny_hf_dir):
    """The whole step's gradients in megatron's buffers (the output weight's written there by the chunks) against
    Hugging Face autograd on the same batch and token-mean NLL, fp32."""
    from tests.helpers.tp_worker import fixed_batch
    from tests.helpers.trainer import make_policy
    from transformers import AutoModelForCausalLM

    from rstar_hpc.trainer.hf_convert import gather_hf_state
    from rstar_hpc.trainer.step import forward_backward

    policy = make_policy(tiny_hf_dir)
    batch = fixed_batch(policy.arch.vocab_size)
    forward_backward(policy, batch)
    got = gather_hf_state(policy, grads=True)
    hf = AutoModelForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32)
    total = sum(int(mb.loss_mask.sum()) for mb in batch)
    for mb in batch:
        for ids, mask in zip(mb.input_ids.split(mb.seqlens), mb.loss_mask.split(mb.seqlens)):
            lp = torch.log_softmax(hf(ids[None]).logits[0, :-1], -1).gather(-1, ids[1:, None])[:, 0]
            (-(lp * mask[1:]).sum() / total).backward()
    want = {k: p.grad for k, p in hf.named_parameters()}
    assert got.keys() == want.keys() and got["lm_head.weight"].abs().sum() > 0
    pad = hf.model.embed_tokens.padding_idx   # HF's embedding never trains its padding row; megatron's has none
    assert pad is not None
    got["model.embed_tokens.weight"][pad] = 0.0
    for k, g in want.items():
        torch.testing.assert_close(got[k], g, rtol=1e-4, atol=1e-6, msg=k)
