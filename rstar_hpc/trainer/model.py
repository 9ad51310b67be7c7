"""The policy: a model of a supported family (arch.py) as megatron-core `GPTModel` chunks, and the whole-logits
forward for evaluation.

Two layer specs build the same parameters:
  * `cuda` with Transformer Engine installed: `get_gpt_layer_with_transformer_engine_spec` (imported lazily).
  * `cpu`, and `cuda` without Transformer Engine: megatron-core's local spec with attention.py's
            `SDPACoreAttention` in place of `DotProductAttention`. One log line says when `cuda` falls back to it.
Both take packed sequences (`PackedSeqParams`, THD layout, attention.py): one row of concatenated samples, RoPE
restarting at every sample, attention block-diagonal and causal.

A mixture-of-experts family (qwen3_moe) gets megatron-core's MoE layer in every layer's MLP: its top-k softmax
router with the load-balancing loss (added to the training loss by megatron's `MoEAuxLossAutoScaler`, logged by
step.py), its all-to-all token dispatcher, and its `SequentialMLP` experts (no grouped GEMM, which needs CUDA). In
the local spec the router is `HostTopKRouter`, and without CUDA the dispatcher `HostAlltoAllTokenDispatcher`: they
run where megatron's assume CUDA (its router moves its weight to the GPU, its dispatcher copies token counts on a
CUDA stream).

The output layer returns the last hidden states, not the logits (`logprobs.HiddenOutputLayer`): the trainer takes
log-probabilities and the loss from them in chunks of tokens (trainer/logprobs.py), never the full-vocabulary
logits; `forward_logits` computes those for evaluation and tests. Megatron pads the vocabulary to a multiple of the
tensor-parallel size; `token_logprobs` (from full logits) and trainer/logprobs.py leave the padded rows out, so the
numbers match the Hugging Face model exactly.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from rstar_hpc.trainer.arch import Arch
# attention.py, once imported, gives every attention layer (either spec) its packed_rope
from rstar_hpc.trainer.attention import CPURotaryEmbedding, SDPACoreAttention
from rstar_hpc.trainer.logprobs import DEFAULT_CHUNK, HiddenOutputLayer, full_logits, output_weight
from rstar_hpc.trainer.parallel_dims import ParallelDims

Backend = Literal["cpu", "cuda"]
log = logging.getLogger(__name__)

if not hasattr(moe_utils, "te_general_gemm"):   # megatron 0.16 leaves it undefined without Transformer Engine, and
    moe_utils.te_general_gemm = None            # its router's gating then fails on a NameError; None: torch's mm


@functools.cache
def have_transformer_engine() -> bool:
    """Is Transformer Engine importable? Says so in the log, once, when it is not."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError as e:
        log.warning("Transformer Engine not found (%s): backend 'cuda' uses megatron-core's local layer spec with "
                    "SDPA attention; pip install -e '.[gpu]' for the Transformer Engine spec", e)
        return False
    return True


def layer_spec(backend: Backend, qk_layernorm: bool = True, num_experts: int | None = None) -> ModuleSpec:
    """Transformer-layer spec: Transformer Engine on CUDA when installed, else local modules + SDPA attention;
    `qk_layernorm`: RMSNorm on each query and key head (Qwen3's); `num_experts`: megatron's MoE layer as the MLP."""
    moe = {"num_experts": num_experts, "moe_grouped_gemm": False} if num_experts else {}
    if backend == "cuda" and have_transformer_engine():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm, **moe)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm", **moe)
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = SDPACoreAttention
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = RMSNorm
    if qk_layernorm:
        attention.q_layernorm = attention.k_layernorm = RMSNorm
    if num_experts:
        spec.submodules.mlp.submodules.router = HostTopKRouter
    return spec


class HostTopKRouter(TopKRouter):
    """megatron's top-k router, its logits computed where its input is: megatron's `gating` moves the weight to
    `torch.cuda.current_device()` first, which a CPU process does not have."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        if input.is_cuda:
            return super().gating(input)
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        return moe_utils.router_gating_linear(input, self.weight, self.bias, dtype)


class HostAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all dispatcher without CUDA: its token counts are host tensors already, so the copies it
    makes on a CUDA side stream (and the wait for them) become conversions in place."""

    def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert: torch.Tensor | None = None):
        if torch.cuda.is_available():
            return super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)
        if not self.drop_and_pad and point == self.cuda_dtoh_point:   # as numpy, as megatron's copy leaves them
            self.input_splits, self.output_splits, self.output_splits_tp = (
                x.numpy() if torch.is_tensor(x) else x
                for x in (self.input_splits, self.output_splits, self.output_splits_tp))
        return tokens_per_expert


def _host_dispatchers(build):
    """Run `build` (a model's construction) so that its MoE layers' all-to-all dispatchers work without CUDA:
    megatron's creates a CUDA stream, shared by all, when the first is built; on a process without CUDA a
    placeholder stands in for it (never used: the dispatchers become `HostAlltoAllTokenDispatcher`)."""
    if torch.cuda.is_available():
        return build()
    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NO_STREAM
    model = build()
    for m in model.modules():
        if isinstance(m, MoELayer) and isinstance(m.token_dispatcher, MoEAlltoAllTokenDispatcher):
            m.token_dispatcher.__class__ = HostAlltoAllTokenDispatcher
    return model


_NO_STREAM = object()


class RMSNorm(torch.nn.RMSNorm):
    """The local spec's RMSNorm (torch's, as megatron's `WrappedTorchNorm` builds it), usable with sequence
    parallelism: `WrappedTorchNorm` refuses it because it leaves its weight unmarked, and a norm that sees 1/tp of
    the tokens has a partial gradient that finalize_model_grads must sum over the tensor-parallel ranks."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel   # type: ignore[attr-defined]


def block_spec(layer: ModuleSpec, config: TransformerConfig, vp_stage: int | None) -> ModuleSpec:
    """The decoder of this rank's chunk: `layer` repeated, and the final norm: the local spec's `RMSNorm`, the
    Transformer Engine spec's own."""
    if layer.submodules.input_layernorm is not RMSNorm:
        return layer   # TE: megatron makes the block (TENorm last)
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(layer_specs=[layer] * n,
                                                                                      layer_norm=RMSNorm))


@dataclass(frozen=True)
class Recompute:
    """Activation recompute (`trainer.recompute*`): none, selective (these modules of every layer) or full
    (blocks of `num_layers` layers, megatron's uniform method)."""

    granularity: Literal["none", "selective", "full"] = "none"
    modules: tuple[str, ...] = ("core_attn",)
    num_layers: int = 1

    def config_fields(self) -> dict:
        if self.granularity == "selective":
            return {"recompute_granularity": "selective", "recompute_modules": list(self.modules)}
        if self.granularity == "full":
            return {"recompute_granularity": "full", "recompute_method": "uniform",
                    "recompute_num_layers": self.num_layers}
        return {}


def transformer_config(arch: Arch, *, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1,
                       backend: Backend = "cpu", params_dtype: torch.dtype = torch.float32,
                       recompute: Recompute = Recompute(), sequence_parallel: bool = False,
                       gradient_accumulation_fusion: bool = False) -> TransformerConfig:
    on_gpu = backend == "cuda"
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        # the experts' parameters are then reduced over their own data-parallel group, not the whole one
        expert_model_parallel_size=ep,
        pipeline_dtype=params_dtype,
        # packed micro-batches differ in length: stages exchange shapes before activations. Not with virtual
        # stages: with pp=2 the previous and the next stage are one rank, and megatron's shape exchange (one
        # batch of isend/irecv on one group) mixes up the two directions; micro-batches are then padded to one
        # length (step.py). Its unbatched p2p keeps the directions on two groups: used on gloo, and for pp=2
        batch_p2p_comm=on_gpu and not (pp == 2 and vpp is not None),
        variable_seq_lengths=vpp is None,
        # megatron refuses variable lengths with 'allgather'
        moe_token_dispatcher_type="alltoall",
        **moe_config_fields(arch),
        # the loss function returns sums; finalize_model_grads divides by the step's trained tokens, all ranks
        calculate_per_token_loss=True,
        deallocate_pipeline_outputs=True,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        # megatron's fused bias-SwiGLU / bias-dropout-add (torch.compile) are CUDA-only; used by both specs there
        bias_activation_fusion=on_gpu,
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=on_gpu,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        sequence_parallel=sequence_parallel,
        gradient_accumulation_fusion=gradient_accumulation_fusion,
        **recompute.config_fields(),
    )


def moe_config_fields(arch: Arch) -> dict:
    """megatron's MoE settings for a mixture-of-experts `arch` (none for a dense one). Hugging Face's router is a
    softmax over all experts, then the top k, renormalised to sum to 1 with `norm_topk_prob`; megatron's softmax
    over the top-k logits is that renormalised form, its softmax before the top k the other."""
    if not arch.is_moe:
        return {}
    return {"num_moe_experts": arch.num_experts, "moe_ffn_hidden_size": arch.moe_intermediate_size,
            "moe_router_topk": arch.num_experts_per_tok, "moe_router_score_function": "softmax",
            "moe_router_pre_softmax": not arch.norm_topk_prob, "moe_router_dtype": "fp32",
            "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": arch.router_aux_loss_coef,
            "moe_grouped_gemm": False, "moe_permute_fusion": False}


def build_model(arch: Arch, *, backend: Backend = "cpu", params_dtype: torch.dtype = torch.float32,
                seed: int = 0, vp_stage: int | None = None, recompute: Recompute = Recompute(),
                sequence_parallel: bool = False, gradient_accumulation_fusion: bool = False,
                logprob_chunk: int = DEFAULT_CHUNK) -> GPTModel:
    """A randomly initialised policy chunk on this rank (its tensor-parallel shard of its pipeline stage, or of
    virtual stage `vp_stage`); load weights with hf_convert. Needs `init_distributed` first (Megatron reads the
    groups at construction). `parallel.build_policy` builds every chunk of a rank and wraps them for training.
    """
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("call rstar_hpc.trainer.parallel.init_distributed(...) before build_model")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    ParallelDims(world_size=torch.distributed.get_world_size(), tp=tp, pp=pp, vpp=vpp, ep=ep).check_model(arch)
    torch.manual_seed(seed)
    if backend == "cuda":  # weights are initialised on the GPU, from megatron's CUDA RNG tracker
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = transformer_config(arch, tp=tp, pp=pp, vpp=vpp, ep=ep, backend=backend, params_dtype=params_dtype,
                                recompute=recompute, sequence_parallel=sequence_parallel,
                                gradient_accumulation_fusion=gradient_accumulation_fusion)
    model = _host_dispatchers(lambda: GPTModel(
        config=config,
        transformer_layer_spec=block_spec(layer_spec(backend, arch.qk_norm, arch.num_experts or None), config,
                                          vp_stage),
        vocab_size=arch.padded_vocab_size(tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,  # a float is fine and keeps theta exact
        rotary_percent=1.0,
        vp_stage=vp_stage,
    ))
    if backend == "cpu":
        model.rotary_pos_emb = CPURotaryEmbedding(kv_channels=arch.head_dim, rotary_percent=1.0,
                                                  rotary_base=arch.rope_theta, use_cpu_initialization=True,
                                                  cp_group=model.pg_collection.cp)
    if arch.rope_scaling is not None:
        # megatron's own `rope_scaling` takes the factor only (the other three fixed at Llama 3.1's); its
        # scaling function, given all four, is transformers' `_compute_llama3_parameters`
        r, rope = arch.rope_scaling, model.rotary_pos_emb
        rope.inv_freq = rope._apply_scaling(rope.inv_freq, factor=r.factor, low_freq_factor=r.low_freq_factor,
                                            high_freq_factor=r.high_freq_factor,
                                            original_max_position_embeddings=r.original_max_position_embeddings)
    model.arch = arch  # type: ignore[attr-defined]  # for token_logprobs and hf_convert
    model.logprob_chunk = logprob_chunk  # type: ignore[attr-defined]  # tokens per chunk of trainer/logprobs.py
    if model.post_process:  # same parameters and checkpoints; forward returns the hidden states
        model.output_layer.__class__ = HiddenOutputLayer
    for p in model.parameters():  # the local spec's torch norms ignore params_dtype (Megatron-LM casts whole)
        p.data = p.data.to(params_dtype)
    if backend == "cuda":
        model.cuda()
    return model


def forward_logits(model: GPTModel, input_ids: torch.Tensor,
                   packed: PackedSeqParams | None = None) -> torch.Tensor:
    """Logits [b, s, vocab/tp] (this rank's vocabulary shard, padding included), all at once."""
    hidden = model(input_ids=input_ids, position_ids=None, attention_mask=None, packed_seq_params=packed)
    return full_logits(hidden, output_weight(model))


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p(target) per position from vocab-parallel logits [b, s, v/tp]; padded vocab rows never count."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    shard = logits.size(-1)
    first = tp_rank * shard
    if first + shard > vocab_size:
        # padded columns get -inf-like logits, so softmax matches the unpadded Hugging Face model
        cols = torch.arange(first, first + shard, device=logits.device)
        logits = logits.masked_fill(cols >= vocab_size, torch.finfo(logits.dtype).min)
    # vocab_parallel_cross_entropy wants [s, b, v/tp] and fp32 for a stable log-sum-exp
    ce = tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).float().contiguous(),
                                                      targets.transpose(0, 1).contiguous())
    return -ce.transpose(0, 1)
