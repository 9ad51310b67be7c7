"""Hugging Face <-> megatron-core GPTModel weights of each family (Qwen3, Qwen2, Llama, Qwen3 MoE), exact both
ways, tensor-parallel aware. The families share the names; Qwen3 adds the query and key head norms (`q_norm`,
`k_norm`), Qwen2 the query, key and value biases, Qwen3 MoE experts in place of the MLP.

Layout facts the mapping rests on (megatron-core 0.16):
  * `linear_qkv.weight` is fused and interleaved per query group: for each of the `num_kv_heads` groups,
    its `num_heads / num_kv_heads` query heads, then its key head, then its value head (rows of `head_dim`).
    Tensor parallelism gives each rank whole groups, so a rank's shard is the same layout over its groups.
    `linear_qkv.bias` (Qwen2's q/k/v biases) is interleaved and split the same way.
  * `linear_fc1.weight` is [gate; up], each half split by tensor parallelism: rank r holds
    [gate_r; up_r], not a slice of the full [gate; up].
  * column-parallel weights (qkv, fc1, embeddings, output layer) split dim 0; row-parallel ones
    (`linear_proj`, `linear_fc2`) split dim 1; norms are replicated.
  * the Transformer Engine spec fuses the pre-norms into the next linear (`linear_qkv.layer_norm_weight`,
    `linear_fc1.layer_norm_weight`); the local spec names them `input_layernorm` / `pre_mlp_layernorm`.
    Both are handled by looking at which names the model has.
  * Megatron's vocabulary is padded to a multiple of tp; the padding rows are zero and dropped on export.
  * experts (megatron's `SequentialMLP`): HF `mlp.gate.weight` (the router, [experts, hidden]) is `mlp.router.weight`,
    replicated; expert e's `mlp.experts.{e}.{gate,up,down}_proj.weight` are `mlp.experts.local_experts.{e}.linear_fc1`
    ([gate; up], split as the dense one: expert tensor parallelism is tp) and `linear_fc2`. The pre-MLP norm stays
    `pre_mlp_layernorm` in the Transformer Engine spec too (megatron fuses it into dense MLPs only).
  * pipeline parallelism gives each chunk a run of layers, numbered from 0 in the chunk (`decoder.layers.{i -
    offset}`); the embedding lives on the first stage, the final norm and output layer on the last. Loading maps
    only the chunk's layers; exporting writes each stage's tensors from that stage (its own safetensors files),
    and global rank 0 writes the index.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from megatron.core import parallel_state
from safetensors import safe_open
from safetensors.torch import save_file

from rstar_hpc.models.families import FAMILIES
from rstar_hpc.trainer.arch import Arch

# files the rollout engines need besides the weights; copied on export when present
AUX_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
             "generation_config.json", "chat_template.jinja", "added_tokens.json")


# --------------------------------------------------------------------------------------------------
# pure mappings (no process groups): full HF tensors <-> one tensor-parallel rank's Megatron tensors


def _split_qkv_groups(arch: Arch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[q; k; v] (HF weights, or biases) -> Megatron's per-group interleaved fused rows, all groups."""
    tail = q.shape[1:]
    groups = [x.reshape(arch.num_kv_heads, -1, *tail) for x in (q, k, v)]
    return torch.cat(groups, dim=1).reshape(-1, *tail)


def _merge_qkv_groups(arch: Arch, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per = arch.num_heads // arch.num_kv_heads
    hd, tail = arch.head_dim, fused.shape[1:]
    q, k, v = fused.reshape(arch.num_kv_heads, (per + 2) * hd, *tail).split([per * hd, hd, hd], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    if w.size(0) == rows:
        return w
    return torch.cat([w, w.new_zeros(rows - w.size(0), *w.shape[1:])])


def hf_to_megatron(hf: dict[str, torch.Tensor], arch: Arch, tp: int, tp_rank: int,
                   names: set[str], layers: range | None = None) -> dict[str, torch.Tensor]:
    """The Megatron tensors of rank `tp_rank` (of `tp`) from full HF tensors.

    `names` are the model's (chunk's) parameter names: they tell local from TE layout, tied from untied, and
    whether the chunk has the embedding and the output layer. `layers`: the chunk's global layer indices (all by
    default); they are numbered from 0 in the result, as in the chunk.
    """
    def col(w: torch.Tensor) -> torch.Tensor:
        return w.chunk(tp, dim=0)[tp_rank]

    def row(w: torch.Tensor) -> torch.Tensor:
        return w.chunk(tp, dim=1)[tp_rank]

    vocab = arch.padded_vocab_size(tp)
    layers = range(arch.num_layers) if layers is None else layers
    out = {}
    if "embedding.word_embeddings.weight" in names:
        out["embedding.word_embeddings.weight"] = col(_pad_rows(hf["model.embed_tokens.weight"], vocab))
    if "decoder.final_layernorm.weight" in names:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if "output_layer.weight" in names:
        head = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])  # tied HF -> untied Megatron
        out["output_layer.weight"] = col(_pad_rows(head, vocab))
    for i in layers:
        h, m = f"model.layers.{i}.", f"decoder.layers.{i - layers.start}."
        fused = _split_qkv_groups(arch, hf[h + "self_attn.q_proj.weight"], hf[h + "self_attn.k_proj.weight"],
                                  hf[h + "self_attn.v_proj.weight"])
        out[m + "self_attention.linear_qkv.weight"] = col(fused)  # whole groups per rank
        if arch.qkv_bias:
            biases = (hf[h + f"self_attn.{p}_proj.bias"] for p in "qkv")
            out[m + "self_attention.linear_qkv.bias"] = col(_split_qkv_groups(arch, *biases))
        out[m + "self_attention.linear_proj.weight"] = row(hf[h + "self_attn.o_proj.weight"])
        if arch.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = hf[h + "self_attn.q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[h + "self_attn.k_norm.weight"]
        if arch.is_moe:
            out[m + "mlp.router.weight"] = hf[h + "mlp.gate.weight"]
            for j, e in enumerate(_local_experts(arch, names, m)):   # megatron numbers a rank's experts from 0
                x, fc = f"{h}mlp.experts.{e}.", f"{m}mlp.experts.local_experts.{j}.linear_fc"
                out[fc + "1.weight"] = torch.cat([col(hf[x + "gate_proj.weight"]), col(hf[x + "up_proj.weight"])])
                out[fc + "2.weight"] = row(hf[x + "down_proj.weight"])
        else:
            out[m + "mlp.linear_fc1.weight"] = torch.cat([col(hf[h + "mlp.gate_proj.weight"]),
                                                          col(hf[h + "mlp.up_proj.weight"])])
            out[m + "mlp.linear_fc2.weight"] = row(hf[h + "mlp.down_proj.weight"])
        te = m + "self_attention.linear_qkv.layer_norm_weight" in names
        out[m + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight")] = \
            hf[h + "input_layernorm.weight"]
        out[m + ("mlp.linear_fc1.layer_norm_weight" if te and not arch.is_moe else "pre_mlp_layernorm.weight")] = \
            hf[h + "post_attention_layernorm.weight"]
    return out


def _local_experts(arch: Arch, names: set[str], m: str) -> range:
    """The experts of layer prefix `m` a model with these parameter names holds: all of them (names from outside a
    model), or, with expert parallelism, its rank's run of them."""
    local = sum(1 for n in names if n.startswith(m + "mlp.experts.local_experts.") and n.endswith("linear_fc1.weight"))
    if local in (0, arch.num_experts):
        return range(arch.num_experts)
    first = parallel_state.get_expert_model_parallel_rank() * local
    return range(first, first + local)


def megatron_to_hf(shards: list[dict[str, torch.Tensor]], arch: Arch,
                   layers: range | None = None) -> dict[str, torch.Tensor]:
    """HF tensors from the Megatron tensors of every tensor-parallel rank (rank order) of a model, or of a chunk
    holding global `layers` (numbered from 0 in it) and whichever of embedding and output layer it has."""
    first = shards[0]
    layers = range(arch.num_layers) if layers is None else layers

    def col(name: str) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=0)

    def row(name: str) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=1)

    hf = {}
    if "embedding.word_embeddings.weight" in first:
        hf["model.embed_tokens.weight"] = col("embedding.word_embeddings.weight")[: arch.vocab_size]
    if "decoder.final_layernorm.weight" in first:
        hf["model.norm.weight"] = first["decoder.final_layernorm.weight"]
    if not arch.tie_word_embeddings and "output_layer.weight" in first:
        hf["lm_head.weight"] = col("output_layer.weight")[: arch.vocab_size]
    for i in layers:
        h, m = f"model.layers.{i}.", f"decoder.layers.{i - layers.start}."
        q, k, v = _merge_qkv_groups(arch, col(m + "self_attention.linear_qkv.weight"))
        hf[h + "self_attn.q_proj.weight"], hf[h + "self_attn.k_proj.weight"], hf[h + "self_attn.v_proj.weight"] = \
            q, k, v
        if arch.qkv_bias:
            hf[h + "self_attn.q_proj.bias"], hf[h + "self_attn.k_proj.bias"], hf[h + "self_attn.v_proj.bias"] = \
                _merge_qkv_groups(arch, col(m + "self_attention.linear_qkv.bias"))
        hf[h + "self_attn.o_proj.weight"] = row(m + "self_attention.linear_proj.weight")
        if arch.qk_norm:
            hf[h + "self_attn.q_norm.weight"] = first[m + "self_attention.q_layernorm.weight"]
            hf[h + "self_attn.k_norm.weight"] = first[m + "self_attention.k_layernorm.weight"]
        if arch.is_moe:
            hf[h + "mlp.gate.weight"] = first[m + "mlp.router.weight"]
            for e in range(arch.num_experts):
                fc = f"{m}mlp.experts.local_experts.{e}.linear_fc"
                gates, ups = zip(*(s[fc + "1.weight"].chunk(2, dim=0) for s in shards))
                x = f"{h}mlp.experts.{e}."
                hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"] = torch.cat(gates), torch.cat(ups)
                hf[x + "down_proj.weight"] = row(fc + "2.weight")
        else:
            gates, ups = zip(*(s[m + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards))
            hf[h + "mlp.gate_proj.weight"] = torch.cat(gates)
            hf[h + "mlp.up_proj.weight"] = torch.cat(ups)
            hf[h + "mlp.down_proj.weight"] = row(m + "mlp.linear_fc2.weight")
        te = m + "self_attention.linear_qkv.layer_norm_weight" in first
        hf[h + "input_layernorm.weight"] = first[m + ("self_attention.linear_qkv.layer_norm_weight" if te
                                                      else "input_layernorm.weight")]
        hf[h + "post_attention_layernorm.weight"] = first[m + ("mlp.linear_fc1.layer_norm_weight" if te and not
                                                               arch.is_moe else "pre_mlp_layernorm.weight")]
    return {k: v.contiguous() for k, v in hf.items()}


# --------------------------------------------------------------------------------------------------
# files


def read_hf_weights(hf_dir: Path | str, want=None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors checkpoint (single file or sharded with an index); `want(name)` picks some."""
    hf_dir = Path(hf_dir)
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{hf_dir}: no *.safetensors files; save the model with "
                                f"save_pretrained(..., safe_serialization=True)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():  # noqa: SIM118  (safe_open handles are not mappings)
                if want is None or want(k):
                    out[k] = fh.get_tensor(k)
    return out


def _model_names(model: torch.nn.Module) -> set[str]:
    return {k for k in model.state_dict() if not k.endswith("_extra_state")}


def _chunks(model: torch.nn.Module) -> list[tuple[torch.nn.Module, range]]:
    """(GPTModel, its global layer indices) for each chunk of a `parallel.Policy`, or for one whole GPTModel."""
    if hasattr(model, "modules_with_offsets"):
        return [(m, range(o, o + len(m.decoder.layers))) for m, o in model.modules_with_offsets()]
    return [(model, range(model.arch.num_layers))]  # type: ignore[attr-defined]


def _wanted(layers: range, names: set[str]):
    """Which HF tensors a chunk with these layers and parameter names is made from."""
    def want(k: str) -> bool:
        if k.startswith("model.layers."):
            return int(k.split(".")[2]) in layers
        if k == "model.norm.weight":
            return "decoder.final_layernorm.weight" in names
        return "embedding.word_embeddings.weight" in names or "output_layer.weight" in names
    return want


@torch.no_grad()
def load_hf_checkpoint(model: torch.nn.Module, hf_dir: Path | str) -> None:
    """Copy a Hugging Face checkpoint into `model` (a `parallel.Policy` or one GPTModel: this rank's
    tensor-parallel shard of its chunks), exactly; each chunk reads only its own tensors.

    Raises if the architectures differ or a tensor is missing or left over, naming it.
    """
    arch: Arch = model.arch  # type: ignore[attr-defined]
    disk = Arch.from_hf_config(hf_dir)
    if disk != arch:
        diff = {k: (v, getattr(disk, k)) for k, v in arch.to_dict().items() if getattr(disk, k) != v}
        raise ValueError(f"{hf_dir}: checkpoint architecture differs from the model (model, checkpoint): {diff}; "
                         f"build the model from this checkpoint's config.json")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    for chunk, layers in _chunks(model):
        names = _model_names(chunk)
        try:
            mine = hf_to_megatron(read_hf_weights(hf_dir, _wanted(layers, names)), arch, tp, rank, names, layers)
        except KeyError as e:
            raise KeyError(f"{hf_dir}: tensor {e.args[0]} missing from the safetensors files") from e
        params = dict(chunk.state_dict(keep_vars=True))
        missing = sorted(n for n in names if n not in mine and not n.endswith("inv_freq"))
        if missing:
            raise KeyError(f"no Hugging Face source for model tensors {missing[:5]}; the model is not a {arch.family} "
                           f"GPTModel")
        for name, value in mine.items():
            target = params[name]
            if target.shape != value.shape:
                raise ValueError(f"{name}: checkpoint gives shape {tuple(value.shape)}, model has "
                                 f"{tuple(target.shape)}")
            target.data.copy_(value.to(target.dtype))


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    """A parameter's gradient: megatron DDP's `main_grad` buffer when wrapped, else `.grad` (zeros if none)."""
    g = getattr(p, "main_grad", None)
    g = p.grad if g is None else g
    return (torch.zeros_like(p) if g is None else g).detach()


def _all_experts(mine: dict[str, torch.Tensor], arch: Arch) -> dict[str, torch.Tensor]:
    """`mine` with every expert-parallel rank's experts, named by their global index (rank r's local expert j is
    expert r * experts_per_rank + j); every expert-parallel rank must call it."""
    ep = parallel_state.get_expert_model_parallel_world_size()
    if ep == 1:
        return mine
    group, per_rank, key = parallel_state.get_expert_model_parallel_group(), arch.num_experts // ep, \
        ".mlp.experts.local_experts."
    out = {k: v for k, v in mine.items() if key not in k}
    for name in sorted(k for k in mine if key in k):   # same names, same order on every rank
        parts = [torch.empty_like(mine[name]) for _ in range(ep)]
        torch.distributed.all_gather(parts, mine[name].contiguous(), group=group)
        head, rest = name.split(key)
        local, tail = rest.split(".", 1)
        out.update({f"{head}{key}{r * per_rank + int(local)}.{tail}": t for r, t in enumerate(parts)})
    return out


@torch.no_grad()
def stage_hf_state(model: torch.nn.Module, grads: bool = False) -> dict[str, torch.Tensor] | None:
    """This pipeline stage's HF tensors (or, with `grads`, gradients in HF layout) on its tensor-parallel rank 0,
    None on the other tp ranks; every tp rank must call it, and with expert parallelism every expert-parallel rank
    (the experts are gathered onto expert-parallel rank 0, which returns them)."""
    arch: Arch = model.arch  # type: ignore[attr-defined]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    out: dict[str, torch.Tensor] = {}
    for chunk, layers in _chunks(model):
        if grads:
            mine = {k: _grad(p) for k, p in chunk.named_parameters()}
        else:
            mine = {k: v.detach() for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")
                    and isinstance(v, torch.Tensor)}
        mine = _all_experts(mine, arch)
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
        for name in sorted(mine):  # same order on every rank
            parts = [mine[name]]
            if tp > 1:
                parts = [torch.empty_like(mine[name]) for _ in range(tp)]
                torch.distributed.all_gather(parts, mine[name].contiguous(),
                                             group=parallel_state.get_tensor_model_parallel_group())
            for r in range(tp):  # a copy: the parameters and gradient buffers move on with training
                shards[r][name] = parts[r].to("cpu", copy=True)
        out.update(megatron_to_hf(shards, arch, layers))
    first = parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_expert_model_parallel_rank() == 0
    return out if first else None


@torch.no_grad()
def gather_hf_state(model: torch.nn.Module, grads: bool = False) -> dict[str, torch.Tensor] | None:
    """Full HF tensors (or, with `grads`, the parameters' gradients in HF layout) on the first rank of the
    model-parallel group (tp and pp rank 0), None elsewhere; every tp and pp rank must call it (and every
    expert-parallel rank: `stage_hf_state`). Gathering a
    large model's stages onto one rank is for tests and small models; `export_hf_checkpoint` writes per stage."""
    mine = stage_hf_state(model, grads)
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return mine
    group = parallel_state.get_pipeline_model_parallel_group()
    first = parallel_state.get_pipeline_model_parallel_first_rank()
    stages = [None] * torch.distributed.get_world_size(group) if torch.distributed.get_rank() == first else None
    torch.distributed.gather_object(mine, stages, dst=first, group=group)
    if stages is None:
        return None
    return {k: v for part in stages if part is not None for k, v in part.items()}


def export_hf_checkpoint(model: torch.nn.Module, out_dir: Path | str, *, source_dir: Path | str,
                         max_shard_bytes: int = 5 * 2**30) -> Path | None:
    """Write `model` as a Hugging Face checkpoint (config.json, safetensors, index when sharded).

    `source_dir` is the checkpoint it came from: its config.json (with the family's model_type and architectures)
    and tokenizer files are copied. Collective over
    the tensor- and pipeline-parallel groups: tp rank 0 of each stage writes that stage's safetensors files (named
    by stage when there are several); the first stage's writes the rest and gets the directory, others get None.
    """
    out, source = Path(out_dir), Path(source_dir)
    pp, stage = parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_rank()
    hf = stage_hf_state(model)
    written = None  # (tensor -> file, bytes, dtype) of this stage
    if hf is not None:
        out.mkdir(parents=True, exist_ok=True)
        written = (_write_safetensors(hf, out, max_shard_bytes, "model" if pp == 1 else f"model-stage{stage:03d}"),
                   sum(t.numel() * t.element_size() for t in hf.values()), str(next(iter(hf.values())).dtype))
    stages = [written]
    if pp > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        first = parallel_state.get_pipeline_model_parallel_first_rank()
        stages = [None] * torch.distributed.get_world_size(group) if torch.distributed.get_rank() == first else None
        torch.distributed.gather_object(written, stages, dst=first, group=group)
    if stages is None or stages[0] is None:
        return None
    files = {k: v for m, _, _ in stages for k, v in m.items()}
    config = json.loads((source / "config.json").read_text())
    family = FAMILIES[model.arch.family]  # type: ignore[attr-defined]
    config["model_type"], config["architectures"] = family.model_type, [family.architecture]
    config["torch_dtype"] = stages[0][2].removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in AUX_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    if len(set(files.values())) > 1:
        index = {"metadata": {"total_size": sum(n for _, n, _ in stages)}, "weight_map": dict(sorted(files.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def _write_safetensors(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int, stem: str) -> dict[str, str]:
    """Write `tensors` as `<stem>.safetensors`, or `<stem>-0000i-of-0000n.safetensors` past max_shard_bytes;
    returns tensor name -> file name."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"{stem}.safetensors" if len(shards) == 1 else f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    return weight_map
