"""The policy: a Qwen3-architecture decoder as a megatron-core `GPTModel`.

Qwen3 = pre-norm RMSNorm, SwiGLU MLP, RoPE (rotate-half), grouped-query attention, RMSNorm on each query and
key head before RoPE (`qk_layernorm`), no biases, untied embeddings on the larger models.

Two layer specs build the same parameters:
  * `cuda` with Transformer Engine installed: `get_gpt_layer_with_transformer_engine_spec` (imported lazily).
  * `cpu`, and `cuda` without Transformer Engine: megatron-core's local spec with `SDPACoreAttention` in place
            of `DotProductAttention` (which refuses packed sequences); on CUDA, SDPA dispatches to the flash or
            memory-efficient attention kernels (bf16/fp16). One log line says when `cuda` falls back to it.
Both take packed sequences (`PackedSeqParams`, THD layout): one row of concatenated samples, RoPE restarting at
every sample, attention block-diagonal and causal.

The output layer returns the last hidden states, not the logits (`logprobs.HiddenOutputLayer`): the trainer takes
log-probabilities and the loss from them in chunks of tokens (trainer/logprobs.py), never the full-vocabulary
logits; `forward_logits` computes those for evaluation and tests. Megatron pads the vocabulary to a multiple of the
tensor-parallel size; `token_logprobs` (from full logits) and trainer/logprobs.py leave the padded rows out, so the
numbers match the Hugging Face model exactly.
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb as _megatron_rope
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import attention as megatron_attention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

try:
    from torch.nn.attention.varlen import varlen_attn
    _VARLEN_ARGS = set(inspect.signature(varlen_attn).parameters)   # torch 2.10 took is_causal, later window_size
except ImportError:  # torch without the flash varlen entry point: per-sample calls
    varlen_attn, _VARLEN_ARGS = None, set()

from rstar_hpc.models.shapes import ModelShape, read_hf_config
from rstar_hpc.trainer.logprobs import DEFAULT_CHUNK, HiddenOutputLayer, full_logits, output_weight

Backend = Literal["cpu", "cuda"]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Qwen3Arch(ModelShape):
    """The architecture numbers of a Qwen3 checkpoint (its config.json, parsed by models.shapes), checked to be a
    dense Qwen3 with plain RoPE: what the trainer builds."""

    @classmethod
    def from_hf_config(cls, config: dict | Path | str) -> Qwen3Arch:
        """Read a Hugging Face `config.json` (a dict, the file, or its directory)."""
        config = read_hf_config(config)
        arch = config.get("architectures") or []
        if config.get("model_type") != "qwen3" and "Qwen3ForCausalLM" not in arch:
            raise ValueError(f"model_type={config.get('model_type')!r}, architectures={arch}: the trainer builds "
                             f"Qwen3 (dense) models only; convert or pick a Qwen3 checkpoint")
        rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"rope type {rope_type!r} is not supported by the trainer (plain RoPE only)")
        if config.get("attention_bias", False):
            raise ValueError("attention_bias=true: Qwen3 has no attention biases; this checkpoint is not Qwen3")
        return super().from_hf_config(config)

    def to_dict(self) -> dict:
        return asdict(self)

    def padded_vocab_size(self, tp: int, multiple: int = 1) -> int:
        """Vocabulary rows in Megatron: a multiple of tp (VocabParallelEmbedding splits evenly)."""
        step = tp * multiple
        return math.ceil(self.vocab_size / step) * step


# --------------------------------------------------------------------------------------------------
# parallel layout (the world itself: parallel.py)


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees of the trainer: world = tp * pp * dp (dp derived); vpp model chunks per pipeline rank."""

    world_size: int
    tp: int = 1
    pp: int = 1
    vpp: int | None = None

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1 or self.world_size % (self.tp * self.pp):
            raise ValueError(f"WORLD_SIZE={self.world_size} is not a multiple of tensor_parallel_size ({self.tp}) "
                             f"x pipeline_parallel_size ({self.pp}) = {self.tp * self.pp}; change the degrees "
                             f"or the number of trainer ranks")
        if self.vpp is not None and self.pp == 1:
            raise ValueError(f"virtual_pipeline_parallel_size={self.vpp} needs pipeline_parallel_size > 1")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    def check_model(self, arch: Qwen3Arch) -> None:
        """Head counts must split evenly over tensor-parallel ranks, layers over pipeline stages."""
        for name, n in (("num_attention_heads", arch.num_heads), ("num_key_value_heads", arch.num_kv_heads),
                        ("intermediate_size", arch.intermediate_size)):
            if n % self.tp:
                raise ValueError(f"{name}={n} is not divisible by tensor_parallel_size={self.tp}; "
                                 f"pick a tensor_parallel_size that divides it")
        stages = self.pp * (self.vpp or 1)
        if arch.num_layers % stages:
            raise ValueError(f"num_hidden_layers={arch.num_layers} is not divisible by pipeline_parallel_size="
                             f"{self.pp} x virtual_pipeline_parallel_size={self.vpp or 1}; pick degrees that divide it")



# --------------------------------------------------------------------------------------------------
# CPU attention


class SDPACoreAttention(MegatronModule):
    """Core attention via `torch.nn.functional.scaled_dot_product_attention` (CPU, or any device).

    Same constructor and call as megatron-core's `DotProductAttention`; causal, grouped-query (kv heads are
    shared, not copied), and packed THD sequences (`_packed`).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention has no context parallelism; use the cuda (TE) spec")
        tp = pg_collection.tp.size() if pg_collection is not None else \
            parallel_state.get_tensor_model_parallel_world_size()
        self.num_heads = config.num_attention_heads // tp
        self.num_groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params: PackedSeqParams | None = None):
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention takes no attention_bias")
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        dropout = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed(query, key, value, packed_seq_params, causal, dropout)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask  # Megatron: True = masked out; SDPA: True = may attend
            if causal:
                s_q, s_k = q.size(2), k.size(2)
                mask = mask & torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril()
            causal = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                             scale=self.softmax_scale, enable_gqa=self.num_groups != self.num_heads)
        s, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


    def _packed(self, query, key, value, packed: PackedSeqParams, causal: bool, dropout: float) -> torch.Tensor:
        """[t, h, d] packed samples, attention within each. On CUDA in bf16/fp16: torch's flash varlen kernel, one
        call per layer, lengths from the device's cu_seqlens (no host sync). Elsewhere one causal SDPA call per
        sample, costing sum(s_i^2), not t^2: on the CPU it beat one block-diagonal masked call (docs/gpu-trainer.md),
        and cu_seqlens is a host tensor there."""
        cu = packed.cu_seqlens_q if packed.cu_seqlens_q_padded is None else packed.cu_seqlens_q_padded
        gqa = self.num_groups != self.num_heads
        if (varlen_attn is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)
                and not dropout and packed.max_seqlen_q is not None):
            kw = ({"window_size": (-1, 0) if causal else (-1, -1)} if "window_size" in _VARLEN_ARGS
                  else {"is_causal": causal})
            if "enable_gqa" in _VARLEN_ARGS:
                kw["enable_gqa"] = gqa
            elif gqa:   # flash takes fewer key/value heads itself; this torch's wrapper does not say so
                reps = self.num_heads // self.num_groups
                key, value = key.repeat_interleave(reps, dim=1), value.repeat_interleave(reps, dim=1)
            out = varlen_attn(query, key, value, cu.to(torch.int32), cu.to(torch.int32), packed.max_seqlen_q,
                              packed.max_seqlen_q, scale=self.softmax_scale, **kw)
            return out.reshape(query.size(0), -1)
        lens = (cu[1:] - cu[:-1]).tolist()
        outs = []
        for q, k, v in zip(query.split(lens), key.split(lens), value.split(lens)):
            q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal,
                                               scale=self.softmax_scale, enable_gqa=gqa)
            outs.append(o.squeeze(0).permute(1, 0, 2))
        return torch.cat(outs).reshape(query.size(0), -1)


class CPURotaryEmbedding(RotaryEmbedding):
    """megatron-core's RoPE without its move of `inv_freq` to the current CUDA device (CPU has none)."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # rotate-half layout, as Qwen3


def packed_rope(t: torch.Tensor, freqs: torch.Tensor, config: TransformerConfig, cu_seqlens: torch.Tensor | None = None,
                mscale: float = 1.0, cp_group=None) -> torch.Tensor:
    """megatron-core's `apply_rotary_pos_emb`, with packed (THD) rows rotated by positions found on the device.
    Megatron's unfused THD path reads `cu_seqlens` to the host (`.tolist()`) for the query and the key of every
    layer, so the host waits for the GPU twice a layer; here each token's position within its sample is
    `i - cu_seqlens[sample of i]` (a `searchsorted`), and one gather of `freqs` gives the same rotation. Megatron's
    own path is kept where it differs: fused RoPE (Transformer Engine), context parallelism, MLA."""
    if (cu_seqlens is None or config.apply_rope_fusion or config.multi_latent_attention
            or (cp_group is not None and cp_group.size() > 1)):
        return _megatron_rope(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
    idx = torch.arange(t.size(0), device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    starts = cu_seqlens[torch.searchsorted(cu_seqlens, idx, right=True) - 1]
    pos = (idx - starts).long().to(freqs.device)
    return _apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[pos], rotary_interleaved=config.rotary_interleaved,
                                      mscale=mscale).squeeze(1)


# megatron's attention calls the name it imported; every attention layer of this process takes packed_rope
megatron_attention.apply_rotary_pos_emb = packed_rope


def packed_seq_params(seqlens: list[int] | torch.Tensor, device: torch.device | str = "cpu") -> PackedSeqParams:
    """THD metadata for one row of concatenated samples of these lengths."""
    lens = torch.as_tensor(seqlens, dtype=torch.int32)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    cu = cu.to(device)
    m = int(lens.max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=m, max_seqlen_kv=m)


# --------------------------------------------------------------------------------------------------
# specs and model


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


def layer_spec(backend: Backend) -> ModuleSpec:
    """Transformer-layer spec: Transformer Engine on CUDA when installed, else local modules + SDPA attention."""
    if backend == "cuda" and have_transformer_engine():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = SDPACoreAttention
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = RMSNorm
    attention.q_layernorm = attention.k_layernorm = RMSNorm
    return spec


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


def transformer_config(arch: Qwen3Arch, *, tp: int = 1, pp: int = 1, vpp: int | None = None,
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
        add_qkv_bias=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=params_dtype,
        # packed micro-batches differ in length: stages exchange shapes before activations. Not with virtual
        # stages: with pp=2 the previous and the next stage are one rank, and megatron's shape exchange (one
        # batch of isend/irecv on one group) mixes up the two directions; micro-batches are then padded to one
        # length (step.py). Its unbatched p2p keeps the directions on two groups: used on gloo, and for pp=2
        batch_p2p_comm=on_gpu and not (pp == 2 and vpp is not None),
        variable_seq_lengths=vpp is None,
        moe_token_dispatcher_type="alltoall",  # dense model; megatron refuses variable lengths with 'allgather'
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


def build_model(arch: Qwen3Arch, *, backend: Backend = "cpu", params_dtype: torch.dtype = torch.float32,
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
    ParallelDims(world_size=torch.distributed.get_world_size(), tp=tp, pp=pp, vpp=vpp).check_model(arch)
    torch.manual_seed(seed)
    if backend == "cuda":  # weights are initialised on the GPU, from megatron's CUDA RNG tracker
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = transformer_config(arch, tp=tp, pp=pp, vpp=vpp, backend=backend, params_dtype=params_dtype,
                                recompute=recompute, sequence_parallel=sequence_parallel,
                                gradient_accumulation_fusion=gradient_accumulation_fusion)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(layer_spec(backend), config, vp_stage),
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
    )
    if backend == "cpu":
        model.rotary_pos_emb = CPURotaryEmbedding(kv_channels=arch.head_dim, rotary_percent=1.0,
                                                  rotary_base=arch.rope_theta, use_cpu_initialization=True,
                                                  cp_group=model.pg_collection.cp)
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
