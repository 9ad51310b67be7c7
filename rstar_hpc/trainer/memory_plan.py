"""What a trainer layout costs per GPU, before queueing it: `rstar-hpc train CONFIG [overrides] --plan`.

Arithmetic from the config alone (no torch, no GPU): the model's shape (`models.shapes`), the layout
(`trainer.*`, ranks = `launch.trainer.num_nodes x tasks_per_node`) and the stages. Per rank of the busiest
pipeline stage (the first: it holds the most micro-batches in flight, and the embedding; the last stage's output
layer and logits are counted on it too, as the worst case of either):

  weights      parameters of the rank's shard x 2 (bf16) or 4 (fp32) bytes; a mixture-of-experts model's experts
               all count (split over tp x trainer.expert_parallel_size), its router replicated
  grads        megatron DDP's gradient buffer: 4 bytes with grad_reduce_in_fp32 or fp32, else 2
  optimizer    AdamW's two fp32 moments + fp32 main weights (bf16 only): 8 or 12 bytes/param, / dp when
               use_distributed_optimizer
  activations  saved for backward, per token of a full micro-batch (micro_batch_tokens), per layer of the stage,
               x the micro-batches in flight (1F1B: pp on the first stage; interleaved x (1 + (pp-1)/(pp*vpp))).
               bf16/fp32 bytes x [4h (norm inputs, linear inputs) + ((H + 2Hkv)d + (H + Hkv)d + Hd + 3I)/tp
               (q, k, v, their norms' inputs, attention output, MLP: gate+up, SwiGLU out)], flash attention (no
               s^2 term). `selective` drops the recomputed modules' share (core_attn: none with flash attention;
               mlp: 3I/tp; layernorm: 2h), `full` keeps one block input per recompute_num_layers layers plus one
               block's full activations. With experts, the MLP's share is each token's top-k experts': 3kI_e/tp.
  logits       last stage, one chunk of trainer.logprob_chunk_tokens tokens (trainer/logprobs.py): [chunk, vocab/tp]
               in the params dtype + fp32 (softmax and gradient made in place) + the gradient in the params dtype
  overhead     4 GiB: CUDA context, NCCL buffers, allocator fragmentation (a rule of thumb, not a measurement)

Micro-batch plan per stage: kept trajectories per step (prompts_per_step x algo.roc.down_sample_to_n), per
data-parallel rank, the longest trajectory (prompt + response budget), and the micro-batches a rank runs when
every trajectory is that long (an upper bound: packing fills each micro-batch with as many as fit), with the
pipeline bubble that count implies, (pp - 1) / (vpp x m).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from rstar_hpc.models.shapes import ModelShape, model_shape

GIB = 2**30
OVERHEAD_GIB = 4.0


@dataclass
class StagePlan:
    stage: str
    kind: str
    trajectories_per_step: int
    per_dp_rank: int
    max_tokens: int
    micro_batches_max: int
    bubble_max: float


@dataclass
class Plan:
    model: str
    world_size: int
    tp: int
    pp: int
    vpp: int | None
    dp: int
    ep: int
    params_dtype: str
    distributed_optimizer: bool
    recompute: str
    micro_batch_tokens: int
    params_per_rank: int
    memory_gib: dict[str, float] = field(default_factory=dict)
    stages: list[StagePlan] = field(default_factory=list)
    gpu_memory_gib: float | None = None

    @property
    def total_gib(self) -> float:
        return sum(self.memory_gib.values())

    def to_dict(self) -> dict:
        return {**asdict(self), "total_gib": round(self.total_gib, 2),
                "fits": None if self.gpu_memory_gib is None else self.total_gib <= self.gpu_memory_gib}


def params_per_rank(s: ModelShape, tp: int, pp: int, ep: int = 1) -> int:
    """Parameters on one rank of the first (or last) stage: its layers' shard plus one vocabulary matrix; with
    experts, its 1/ep of them split over tp, and the router whole."""
    layers = s.num_layers // pp
    vocab = math.ceil(s.vocab_size / tp) * s.hidden_size
    sharded = s.attention_params + (s.expert_params // ep if s.is_moe else s.mlp_params)
    router = s.mlp_params - s.expert_params if s.is_moe else 0
    return layers * sharded // tp + layers * (s.norm_params + router) + vocab + (s.hidden_size if pp == 1 else 0)


def activation_bytes_per_token_layer(s: ModelShape, tp: int, nbytes: int, recompute: str,
                                     modules: list[str]) -> float:
    """Saved activations of one layer per token (see the module docstring)."""
    h, d, heads, kv = s.hidden_size, s.head_dim, s.num_heads, s.num_kv_heads
    inter = s.num_experts_per_tok * s.moe_intermediate_size if s.is_moe else s.intermediate_size
    norms, mlp = 2 * 2 * h, 3 * inter / tp
    full = norms + (heads + 2 * kv) * d / tp + (heads + kv) * d / tp + heads * d / tp + mlp
    if recompute == "selective":
        full -= (mlp if "mlp" in modules else 0) + (2 * h if "layernorm" in modules else 0)
    return nbytes * full


def _activations(cfg, s: ModelShape, tp: int, pp: int, vpp: int | None, nbytes: int) -> float:
    t = cfg.trainer
    per_layer = activation_bytes_per_token_layer(s, tp, nbytes, t.recompute, list(t.recompute_modules))
    layers = s.num_layers // pp
    if t.recompute == "full":  # block inputs for every layer group, plus one block recomputed at a time
        stored = math.ceil(layers / t.recompute_num_layers) * nbytes * s.hidden_size
        one_block = min(t.recompute_num_layers, layers) * per_layer
        in_flight = pp * (1 + (pp - 1) / (pp * vpp) if vpp else 1)
        return t.micro_batch_tokens * (stored * in_flight + one_block)
    in_flight = pp * (1 + (pp - 1) / (pp * vpp) if vpp else 1)
    return t.micro_batch_tokens * layers * per_layer * in_flight


def _stage_plans(cfg, dp: int, pp: int, vpp: int | None) -> list[StagePlan]:
    out = []
    budget = cfg.trainer.micro_batch_tokens
    for st in cfg.stages:
        if st.kind == "sft":
            n, longest = st.prompts_per_step, budget
        elif st.kind == "rl":
            n = st.prompts_per_step * cfg.algo.trained_per_prompt
            longest = cfg.rollout.agent.max_prompt_length + (st.max_response_length or cfg.rollout.agent.max_response_length)
        else:
            continue
        per_rank = math.ceil(n / dp)
        per_mb = max(1, budget // longest)
        m = math.ceil(per_rank / per_mb)
        if vpp:
            m = math.ceil(m / pp) * pp
        out.append(StagePlan(st.name, st.kind, n, per_rank, longest, m, round((pp - 1) / ((vpp or 1) * m), 4)))
    return out


def make_plan(cfg, gpu_memory_gib: float | None = None) -> Plan:
    """The plan of a validated `RunConfig`; raises ValueError when the model's shape is unknown."""
    found = model_shape(cfg.model)
    if found is None:
        raise ValueError(f"model.path={cfg.model.path}: no config.json there and no published shape matches its "
                         f"name; copy the model's config.json there first")
    s, source = found
    t = cfg.trainer
    tp, pp, vpp = t.tensor_parallel_size, t.pipeline_parallel_size, t.virtual_pipeline_parallel_size
    world = cfg.launch.trainer.num_nodes * cfg.launch.trainer.tasks_per_node
    dp = world // (tp * pp)
    bf16 = t.params_dtype == "bfloat16"
    nbytes = 2 if bf16 else 4
    n = params_per_rank(s, tp, pp, t.expert_parallel_size)
    opt_bytes = (12 if bf16 else 8) * n / (dp if t.use_distributed_optimizer else 1)
    logits = min(t.micro_batch_tokens, t.logprob_chunk_tokens) * math.ceil(s.vocab_size / tp) * (nbytes + 4 + nbytes)
    memory = {"weights": n * nbytes, "grads": n * (4 if (t.grad_reduce_in_fp32 or not bf16) else 2),
              "optimizer": opt_bytes, "activations": _activations(cfg, s, tp, pp, vpp, nbytes), "logits": logits}
    return Plan(model=source, world_size=world, tp=tp, pp=pp, vpp=vpp, dp=dp, ep=t.expert_parallel_size,
                params_dtype=t.params_dtype,
                distributed_optimizer=t.use_distributed_optimizer, recompute=t.recompute,
                micro_batch_tokens=t.micro_batch_tokens, params_per_rank=n,
                memory_gib={**{k: round(v / GIB, 2) for k, v in memory.items()}, "overhead": OVERHEAD_GIB},
                stages=_stage_plans(cfg, dp, pp, vpp), gpu_memory_gib=gpu_memory_gib)


def format_plan(plan: Plan) -> str:
    """The plan as two small tables."""
    lay = (f"tp {plan.tp} x pp {plan.pp}{f' (x vpp {plan.vpp})' if plan.vpp else ''} x dp {plan.dp} = "
           f"{plan.world_size} ranks{f', experts over ep {plan.ep}' if plan.ep > 1 else ''}")
    optimizer = "distributed" if plan.distributed_optimizer else "plain"
    lines = [f"model: {plan.model}",
             (f"layout: {lay}; {plan.params_dtype}, {optimizer} optimizer, recompute {plan.recompute}, "
              f"micro-batches of {plan.micro_batch_tokens} tokens"), "",
             f"per-rank memory, busiest stage ({plan.params_per_rank / 1e9:.2f} B parameters)"]
    lines += [f"  {k:<12}{v:>9.2f} GiB" for k, v in plan.memory_gib.items()]
    verdict = "" if plan.gpu_memory_gib is None else (
        f"  (fits {plan.gpu_memory_gib:g} GiB)" if plan.total_gib <= plan.gpu_memory_gib
        else f"  (does NOT fit {plan.gpu_memory_gib:g} GiB)")
    lines += [f"  {'total':<12}{plan.total_gib:>9.2f} GiB{verdict}", "",
              f"{'stage':<10}{'kind':<6}{'traj/step':>10}{'per dp':>8}{'max len':>9}{'micro-b.':>10}{'bubble':>8}"]
    lines += [f"{s.stage:<10}{s.kind:<6}{s.trajectories_per_step:>10}{s.per_dp_rank:>8}{s.max_tokens:>9}"
              f"{s.micro_batches_max:>10}{s.bubble_max:>8.1%}" for s in plan.stages]
    return "\n".join(lines)
