"""trainer/flops.py, the one FLOP count and MFU behind perf/mfu, gpu-check, the planner and the benches, by hand."""
from __future__ import annotations

import pytest

from rstar_hpc.models.shapes import ModelShape
from rstar_hpc.trainer.flops import mfu, model_flops, peak_tflops


def test_model_flops_by_hand_with_the_attention_term():
    s = ModelShape(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                   head_dim=2, tie_word_embeddings=True)
    # per layer: q 4*2*2 = 16, k and v 2 * 4*1*2 = 16, o 2*2*4 = 16, SwiGLU 3*4*8 = 96: 144; 2 layers and the head
    # (tied: once) 10*4 = 40
    n = 2 * 144 + 40
    linear = 2 * 3 * n * (3 + 5)                 # 3 passes over 8 tokens
    attention = 2 * 3 * 2 * 2 * 2 * (9 + 25)     # 2 * passes * layers * heads * head_dim * sum(s^2)
    assert model_flops(s, [3, 5]) == (linear + attention, n) == (15744 + 1632, 328)
    assert model_flops(s, [3, 5], passes=4)[0] == pytest.approx((linear + attention) * 4 / 3)
    # a mixture of experts counts the top-k experts and the router, not every expert
    moe = ModelShape(**{**vars(s), "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                        "family": "qwen3_moe"})
    assert model_flops(moe, [1])[1] == n + 2 * (2 * 96 + 4 * 8 - 96)


def test_mfu_and_the_peak_by_card_name():
    assert mfu(400e12, 1.0, 989.0) == pytest.approx(400 / 989)
    assert mfu(400e12, 2.0, 1000.0, devices=2) == pytest.approx(0.1)
    assert peak_tflops("NVIDIA H200") == peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("AMD Instinct MI300X") == 1307.0 and peak_tflops("NVIDIA L40S") == 362.0
    assert peak_tflops("NVIDIA GeForce RTX 4090") is None
