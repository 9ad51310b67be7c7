"""Attention over packed sequences (THD: one row of concatenated samples) without Transformer Engine.

`SDPACoreAttention` takes the place of megatron-core's `DotProductAttention` in the local layer spec (which refuses
packed sequences): on CUDA in bf16/fp16 torch's flash varlen kernel, one call per layer; elsewhere SDPA, which
dispatches to the flash or memory-efficient kernels on CUDA. `packed_rope` gives every attention layer of the
process, either spec's, RoPE that restarts at each sample without reading `cu_seqlens` to the host;
`CPURotaryEmbedding` is RoPE's frequency table where there is no CUDA device; `packed_seq_params` the THD metadata
of a row. Attention is block-diagonal and causal.
"""
from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb as _megatron_rope
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import attention as megatron_attention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

try:
    from torch.nn.attention.varlen import varlen_attn
    _VARLEN_ARGS = set(inspect.signature(varlen_attn).parameters)   # torch 2.10 took is_causal, later window_size
except ImportError:  # torch without the flash varlen entry point: per-sample calls
    varlen_attn, _VARLEN_ARGS = None, set()


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
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # rotate-half layout, as every family


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
