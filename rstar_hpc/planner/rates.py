"""The planner's rates: what one GPU does per second, how fast bytes move, how long trajectories are.

Every default names its source. `measured.py` replaces them with a finished run's own rates (`--from-run`).

Hardware (HARDWARE; `--gpu h100|h200|mi300x`), the vendors' published figures:
  peak_tflops   dense BF16 tensor throughput without sparsity: H100 SXM 989 and H200 989 (NVIDIA H100/H200
                datasheets), MI300X 1307 (AMD Instinct MI300X datasheet): trainer/flops.py's PEAK_TFLOPS, which
                the trainer's `perf/mfu` and gpu-check use too.
  hbm_tbs       memory bandwidth: H100 SXM 3.35 TB/s, H200 4.8 TB/s, MI300X 5.3 TB/s (the same datasheets).
  memory_gb     80, 141, 192 GB.

Training:
  mfu           model-FLOPs utilisation of the update (forward + backward + the forward of the pi_old recompute),
                per card: measured where docs/gpu-figures/ holds a file of the card (scripts/gpu-check.sh writes
                them; planner/gpu_figures.py reads the newest: its largest model's RL step with selective recompute,
                the recipe's setting). H200: 0.3575 from 2026-11-27's two runs at qwen3-4b's shape (bf16, 8K packed
                micro-batches, no Transformer Engine: 0.366 and 0.349). Cards without a file, ASSUMED_MFU 0.35:
                Megatron-LM reports 41-48% MFU for dense GPT models on H100 at scale (NVIDIA/Megatron-LM README,
                "weak scaling" table), and an RL step trains one optimizer step on variable-length packed sequences
                with tensor and pipeline parallelism. The plan prints which (`mfu_source`).

Generation (the engine model of planner/engine_sim.py: a decode step costs c0 + c1 x batch + c2 x context tokens
read, prefill p per token). The constants follow from the hardware and the model instead of being fixed:
  c0 = weight bytes / (tp x hbm x decode_efficiency) + tp all-reduces (2 per layer x ALLREDUCE_S when tp > 1)
  c2 = KV bytes per token / (tp x hbm x decode_efficiency)
  p  = 2 x parameters / (tp x peak x prefill_mfu)
  c1 = planner/engine_sim.py's C1 (sampling and scheduling per sequence; host work, not the GPU's)
  decode_efficiency 0.7, prefill_mfu 0.5: with these, a 14B model on one H100 gives c0 = 12.6 ms, c2 = 7e-8 s and
  p = 6e-5 s, planner/engine_sim.py's calibration of a 14B-class engine on one 80 GB GPU (C0 12 ms, C2 5e-8,
  PREFILL 6e-5). ALLREDUCE_S 10 us: NCCL's small-message all-reduce latency inside an NVLink/xGMI node.
  The KV pool of an engine: tp x memory x gpu_memory_utilization - the weights, over the KV bytes per token.

Tools (rStar2-Agent, arXiv 2508.20722 section 3.1): up to 45K tool calls per step at 0.3 s average latency. A step
is 512 prompts x 32 rollouts = 16384 trajectories, so tool_calls_per_traj = 45000 / 16384 = 2.75 (an upper
bound: "up to"); tool_latency_s 0.3. tool_tokens 100 per call is assumed (a tool turn is capped by
rollout.agent.tool_output_max_chars, 1024 characters ~ 256 tokens in the recipe).

Lengths (the paper, section 4.3): the mean response grows from ~1K to ~4K tokens over stage 1 (8K budget) and from
~4K to ~6K over stage 2 (12K); stage 3 is not reported, so stage 2's end, 6K, is assumed. Per rl stage in order:
PAPER_MEAN_RESPONSE = 2500, 5000, 6000 (each stage's midpoint), at most 60% of the stage's budget; later stages
45% of the budget. Lengths are log-normal with sigma LENGTH_SIGMA 0.7, cut at the budget: at a 4K mean that cuts
~8% at 8K, the paper's stage-1 clip ratio of ~10%. prompt_tokens 600: the rStar2 system prompt with the tool
schema (~500 tokens) and a question.

Moving weights and checkpoints (assumed; shared storage varies most between sites, so override them):
  sync_gbs 1.0   the policy through the file system each step: one rank writes the safetensors (~2 GB/s, a single
                 Lustre client's streaming write) and the engines read them back (~2 GB/s each, in parallel):
                 1 GB/s end to end. 14B in bf16 is ~30 GB, so ~30 s a step.
  ckpt_gbs 10    a distributed checkpoint (bf16 weights, fp32 main weights and AdamW's two moments: 14 bytes per
                 parameter) written by every trainer node at once: ~2.5 GB/s per client node x 4 nodes.

Hand-offs: the rollout polls for the next policy (rollout/policy_source.py wait_for_policy) and the trainer for the
next committed step (trainer/rl.py) with exchange/poll.py's Backoff: every tenth of the time waited so far, between
0.1 s and poll_s (1 s). Each sees the other's hand-off half an interval late on average (model.py: per step, from the
waits the step's phases imply): ~1 s a step for a 14B model's minutes-long waits, ~0.1 s for a tiny run's.

The paper's own cost (PAPER): 64 MI300X for about a week (7 days) over 510 RL steps: 10752 GPU-hours, 21.1 per
step, ~1186 s per step.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from rstar_hpc.config.stages import StageConfig
from rstar_hpc.planner.gpu_figures import measured_mfu
from rstar_hpc.trainer.flops import PEAK_TFLOPS

HARDWARE = {
    "h100": {"peak_tflops": PEAK_TFLOPS["h100"], "hbm_tbs": 3.35, "memory_gb": 80.0},
    "h200": {"peak_tflops": PEAK_TFLOPS["h200"], "hbm_tbs": 4.8, "memory_gb": 141.0},
    "mi300x": {"peak_tflops": PEAK_TFLOPS["mi300x"], "hbm_tbs": 5.3, "memory_gb": 192.0},
}
ASSUMED_MFU = 0.35
ASSUMED = "assumed: no docs/gpu-figures file of this card"


def card_mfu(card: str) -> tuple[float, str]:
    """The training MFU of `card` and its source: measured (the newest docs/gpu-figures file), else assumed."""
    return measured_mfu(card) or (ASSUMED_MFU, ASSUMED)


ALLREDUCE_S = 10e-6
PAPER_MEAN_RESPONSE = (2500, 5000, 6000)
LENGTH_SIGMA = 0.7
PAPER = {"gpus": 64, "gpu": "mi300x", "days": 7.0, "rl_steps": 510}
PAPER["gpu_hours"] = PAPER["gpus"] * PAPER["days"] * 24
PAPER["gpu_hours_per_step"] = PAPER["gpu_hours"] / PAPER["rl_steps"]
PAPER["step_s"] = PAPER["days"] * 86400 / PAPER["rl_steps"]


@dataclass
class Rates:
    """What the plan assumes; `source` says where the numbers came from ("defaults", "flags", "run ...")."""

    gpu: str = "h100"
    peak_tflops: float = HARDWARE["h100"]["peak_tflops"]
    hbm_tbs: float = HARDWARE["h100"]["hbm_tbs"]
    memory_gb: float = HARDWARE["h100"]["memory_gb"]
    mfu: float | None = None               # None: the card's, measured or assumed (__post_init__)
    mfu_source: str | None = None
    decode_efficiency: float = 0.7
    prefill_mfu: float = 0.5
    tool_latency_s: float = 0.3
    tool_calls_per_traj: float = 2.75
    tool_tokens: int = 100
    prompt_tokens: int = 600
    sync_gbs: float = 1.0
    ckpt_gbs: float = 10.0
    response_tokens: dict[str, float] = field(default_factory=dict)   # stage -> mean response tokens (all default)
    kept_fraction: float = 1.0             # of prompts_per_step x G that RoC keeps and trains (groups dropped: less)
    poll_s: float = 1.0                    # the roles' longest poll interval (their hand-offs: model.py)
    # measured rates (--from-run): when set they replace the modelled ones
    decode_tok_s: float | None = None      # one engine's generated tokens per second of a step's generation wall
    train_flops: float | None = None       # the trainer's achieved model FLOP/s, all its ranks together
    handover_s: float | None = None        # on-policy: the rollout's generation over -> the trainer has the batch
    source: str = "defaults"

    def __post_init__(self):
        if self.mfu is None:   # one read of docs/gpu-figures for both fields
            self.mfu, source = card_mfu(self.gpu)
            self.mfu_source = self.mfu_source or source
        elif self.mfu_source is None:
            self.mfu_source = "given"

    def with_gpu(self, gpu: str) -> Rates:
        if gpu not in HARDWARE:
            raise ValueError(f"--gpu {gpu}: unknown; known: {', '.join(HARDWARE)} (or give --peak-tflops, --hbm-tbs "
                             f"and --memory-gb)")
        mfu, source = card_mfu(gpu)
        return replace(self, gpu=gpu, **HARDWARE[gpu], mfu=mfu, mfu_source=source)

    def override(self, **values) -> Rates:
        """These rates with the given fields replaced (None values are ignored)."""
        known = {f.name for f in fields(self)}
        bad = sorted(set(values) - known)
        if bad:
            raise ValueError(f"unknown rate(s) {', '.join(bad)}; known: {', '.join(sorted(known))}")
        given = {k: v for k, v in values.items() if v is not None}
        if "mfu" in given:
            given.setdefault("mfu_source", "flags")
        return replace(self, **given, source=self.source if not given else f"{self.source} + flags")

    def mean_response(self, stage_cfg: StageConfig, rl_index: int, budget: int) -> float:
        """The mean response tokens (model and tool tokens) of an rl stage's trajectories."""
        if stage_cfg.name in self.response_tokens:
            return min(float(self.response_tokens[stage_cfg.name]), float(budget))
        if rl_index < len(PAPER_MEAN_RESPONSE):
            return min(PAPER_MEAN_RESPONSE[rl_index], 0.6 * budget)
        return 0.45 * budget

    def to_dict(self) -> dict:
        return asdict(self)
