"""Model FLOPs and MFU: the one definition behind the trainer's `perf/mfu`, scripts/gpu_check.py, the planner
(planner/model.py, planner/measured.py) and bench/trainer_sized.py.

Per pass over samples of lengths s_i:  2 * N * sum(s_i)  +  2 * L * H * d * sum(s_i^2)
  N   the matmul parameters a token goes through: attention projections, the MLP (a mixture of experts: its top-k
      experts and the router, not every expert), the LM head (a tied embedding once, as the LM head); no norms
  2nd causal attention: QK^T and AV, 2 * s^2 * d FLOPs each per head, halved by the causal mask
A training step is 3 passes (forward; backward, twice the forward), an RL step that recomputes pi_old one more.
Flash attention's recomputation in backward and activation recompute are not counted: model FLOPs, as MFU uses.
MFU = model FLOPs / (seconds x devices x the card's dense bf16 peak). No torch here: gpu-check and the planner
import it bare.
"""
from __future__ import annotations

from rstar_hpc.models.shapes import ModelShape

# dense bf16 peak TFLOP/s without sparsity (vendor datasheets), by a name a card's CUDA/ROCm name contains
PEAK_TFLOPS = {"h200": 989.0, "h100": 989.0, "h800": 989.0, "a100": 312.0, "a800": 312.0, "l40s": 362.0,
               "mi300x": 1307.0}


def model_flops(s: ModelShape, seqlens: list[int], passes: int = 3) -> tuple[float, int]:
    """(model FLOPs of `passes` passes over samples of these lengths, N): see the module docstring."""
    h, d = s.hidden_size, s.head_dim
    per_layer = h * d * (s.num_heads + 2 * s.num_kv_heads) + s.num_heads * d * h + s.active_mlp_params
    n = s.num_layers * per_layer + s.vocab_size * h
    attention = 2 * passes * s.num_layers * s.num_heads * d * sum(x * x for x in seqlens)
    return 2.0 * passes * n * sum(seqlens) + attention, n


def card(device_name: str) -> str | None:
    """The card ("h200") a reported name ("NVIDIA H200", "AMD Instinct MI300X") is; None if not one of PEAK_TFLOPS."""
    name = device_name.lower().replace(" ", "")
    return next((k for k in PEAK_TFLOPS if k in name), None)


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a card by its reported name; None if unknown."""
    c = card(device_name)
    return PEAK_TFLOPS[c] if c else None


def mfu(flops: float, seconds: float, peak: float, devices: int = 1) -> float:
    """Model FLOPs utilisation: `flops` done in `seconds` by `devices` cards of `peak` TFLOP/s each."""
    return flops / (seconds * devices * peak * 1e12)
