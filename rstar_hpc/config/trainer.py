"""Knobs of the trainer role (Megatron-core GRPO-RoC and SFT).

The parallel layout (tensor x pipeline x data parallel), the optimizer's sharding and precision, and activation
recompute are configuration; `check_layout` (run by the config loader) rejects combinations that cannot run,
naming the key and the fix. `rstar-hpc train CONFIG --plan` prints what a layout costs per GPU.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rstar_hpc.config.base import Section


class OptimizerConfig(Section):
    lr: float = Field(1e-6, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.01, ge=0)
    warmup_steps: int = Field(20, ge=0)
    """Linear warm-up, then `schedule`: once per phase, in the stage where the optimizer starts it (the first trainer
    stage, the first rl stage after sft, a stage with reset_optimizer); later stages of the phase carry on."""
    schedule: Literal["constant", "cosine"] = "constant"
    """`constant` after warm-up (paper's RL); `cosine` decay (paper's SFT)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Floor of the cosine schedule, as a fraction of lr."""
    grad_clip: float = Field(1.0, gt=0)
    sft_schedule: Literal["constant", "cosine"] = "cosine"
    """Schedule of `kind: sft` stages (the paper's SFT recipe decays); RL stages use `schedule`."""


class CheckpointConfig(Section):
    save_every_steps: int = Field(10, ge=1)
    keep_last: int = Field(3, ge=1)
    """Committed checkpoints kept; the one `latest` points to is never deleted."""
    async_save: bool = False
    """Write checkpoints in the background (megatron-core's async dist-checkpoint save): the loop blocks only while
    the state is planned and copied to host memory (a forked writer process holds that copy), then trains on while
    the shards are written; the commit (COMMITTED.json, rename, `latest`, retention) and the data ack happen when
    the write has finished on every rank, polled after each step. A new save first waits for the previous one;
    the stage's end and USR2/TERM wait for it (so the save on the pre-timeout signal still costs the whole write:
    launch warns when step + save exceed launch.signal_lead_s). A crash before the commit leaves `latest` on the
    previous checkpoint and the data not acked beyond it. Turn it on where a save takes a noticeable part of
    the step (large models on GPUs: configs/qwen3-14b.yaml); it costs one host copy of the rank's shards and a
    forked process per save. `time/checkpoint(s)` logs what the loop blocked, `time/checkpoint_async(s)` the save's
    whole duration, in the step that committed it."""


RecomputeModule = Literal["core_attn", "mlp", "layernorm"]


class TrainerConfig(Section):
    backend: Literal["auto", "cpu", "cuda"] = "auto"
    """`cpu`: gloo + local layer spec; `cuda`: NCCL + the Transformer Engine spec (megatron-core's local spec with
    SDPA attention when TE is not installed, logged once); `auto` picks by GPU presence."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Ranks that split every layer's matmuls (and the vocabulary); keep it within one node (NVLink).
    Must divide the attention heads, the key/value heads and the MLP width."""
    pipeline_parallel_size: int = Field(1, ge=1)
    """Pipeline stages: consecutive layer blocks on different ranks, run by megatron-core's 1F1B schedule over a
    step's micro-batches (the loss and its token masks on the last stage). Must divide the layers. The data-
    parallel size is what is left: trainer ranks / (tensor_parallel_size x pipeline_parallel_size)."""
    expert_parallel_size: int = Field(1, ge=1)
    """Mixture-of-experts models (qwen3_moe): ranks that split each layer's experts among them, taken from the
    data-parallel ranks (megatron's expert parallelism; tokens travel to their experts by all-to-all). Must divide the
    experts and the data-parallel size. Runs on either backend (gloo has the all-to-all; trainer/model.py)."""
    heartbeat_s: float = Field(30.0, gt=0)
    """While a step trains, rank 0 writes the role's heartbeat this often if micro-batches moved since the last one
    (trainer/heartbeat.py): a step longer than launch.hang_timeout_s that makes progress is not taken for hung, one
    that stops moving falls silent. Under half of launch.hang_timeout_s (checked)."""
    collective_timeout_s: float = Field(600.0, ge=30)
    """How long one collective (an all-reduce, a barrier) may wait for the other ranks before this rank fails it
    instead of waiting on: a dead or hung peer then ends the step in bounded time, and the launcher restarts the role
    from its last checkpoint. It holds for the world's group and every Megatron group (tensor, pipeline and data
    parallel, NCCL and their gloo twins), to the second (Megatron's whole-minute setting takes a fraction), and the
    error names the group that timed out. NCCL's watchdog enforces it on GPU, with its async error handling (torch's
    default, TORCH_NCCL_ASYNC_ERROR_HANDLING; a value you set stands); gloo's own timeout on CPU. Keep it above the
    slowest legitimate wait (a rank waits in a barrier while rank 0 writes a synchronous checkpoint or a policy) and
    under launch.hang_timeout_s (checked), so that a stuck collective fails, naming its group, before the launcher
    kills the role as hung."""
    virtual_pipeline_parallel_size: int | None = Field(None, ge=2)
    """Model chunks per pipeline rank (megatron's interleaved 1F1B): a smaller pipeline bubble for more p2p
    traffic. Needs pipeline_parallel_size > 1 and layers divisible by pipeline x virtual size. It runs with one
    activation shape: a step's packed micro-batches are padded to its longest, and their count is rounded up to a
    multiple of pipeline_parallel_size (fillers train nothing), as the interleaved schedule requires. null: off."""
    micro_batch_tokens: int = Field(20480, ge=64)
    """Token budget of one packed micro-batch: trajectories of any length are packed (THD: one row, attention kept
    within each trajectory) into micro-batches of at most this many tokens, so short ones are not padded to the
    longest. Must hold the longest trajectory (prompt + response)."""
    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer: Adam moments and fp32 main weights sharded over data-parallel ranks
    (gradients reduce-scattered, parameters all-gathered), so they cost 1/dp of their size per GPU. Needs a
    data-parallel size > 1."""
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights, activations and gradients of the model. `bfloat16` keeps fp32 main weights in the optimizer (and
    fp32 gradient accumulation with grad_reduce_in_fp32): the update has fp32 precision, the matmuls bf16 speed."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and reduce gradients in fp32 buffers (with bfloat16 params). false halves the gradient buffer
    and its traffic, at the cost of bf16 rounding in accumulation over micro-batches and ranks."""
    sequence_parallel: bool | None = None
    """Megatron's sequence parallelism with tensor_parallel_size > 1: the norms and residuals of each layer work on
    1/tp of the micro-batch's tokens, and the tensor-parallel all-reduces become all-gathers and reduce-scatters
    (the same bytes), so the activations outside the matmuls take 1/tp of the memory. Packed micro-batches are
    padded to a multiple of tp. null: on with tp > 1 on CUDA, off on the CPU, except for a mixture-of-experts model
    (megatron's MoE layer trains with tp > 1 only with it: on on either backend, and false is refused)."""
    overlap_grad_reduce: bool | None = None
    """Reduce each gradient bucket over the data-parallel ranks as soon as the backward pass has filled it, under
    the rest of the backward pass (megatron's DistributedDataParallel). null: on with data-parallel ranks on CUDA.
    (Overlapped parameter gathers for the distributed optimizer are not used: the policy is published and
    checkpointed right after the optimizer step, which would then need the gather first.)"""
    gradient_accumulation_fusion: bool | None = None
    """Weight gradients accumulated straight into the fp32 gradient buffer by the weight-gradient GEMM (Apex's
    fused_weight_gradient_mlp_cuda extension): no bf16 gradient and add per micro-batch. null: on on CUDA where
    the extension imports; true without it fails at start, naming the install."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute: `selective` re-runs `recompute_modules` in the backward pass instead of keeping their
    activations (`mlp` is the large share with flash attention; `core_attn` pays off with unfused attention, whose
    scores grow with the square of the length); `full` keeps only each block of `recompute_num_layers` layers'
    input and re-runs the block (least memory, ~1/3 more compute). `rstar-hpc train --plan` shows the effect."""
    recompute_modules: list[RecomputeModule] = Field(default_factory=lambda: ["core_attn"])
    """`selective` recompute: which parts of each layer (megatron's names and default: core_attn, mlp,
    layernorm)."""
    recompute_num_layers: int = Field(1, ge=1)
    """`full` recompute: layers per recomputed block (uniform method)."""
    logprob_chunk_tokens: int = Field(1024, ge=1)
    """Tokens per chunk of the output layer: the loss, its gradients and the recomputed pi_old are taken chunk by
    chunk from the last hidden states (trainer/logprobs.py), so the fp32 logits of only this many tokens exist at
    once (tokens x vocabulary / tensor_parallel_size x 4 bytes: 0.6 GB at 1024 and Qwen3's 151,936) instead of the
    whole micro-batch's. Smaller: less memory, more, smaller matmuls (bench/logprobs.py)."""
    packed_length_multiple: int | None = Field(None, ge=1)
    """Packed micro-batches are padded (one untrained filler sample) to a multiple of this many tokens, so the
    compiled kernels see a few lengths instead of a new one every micro-batch. null: 256 on CUDA (at most 32 lengths
    at 8,192 tokens, ~1.5% filler), 1 (off) on the CPU, where compute is the cost and nothing is compiled."""
    recompute_old_logprobs: bool = True
    """Recompute pi_old with the trainer (at rollout.agent.temperature, as the engines' logprobs are) instead of
    trusting the engine's logprobs; the importance weight of another policy's tokens needs it (algo.loss.tis_cap)."""
    max_token_staleness: int = Field(1, ge=0)
    """Partial rollouts (rollout.scheduler.partial_rollouts) carry unfinished trajectories into later steps, so a
    trajectory's tokens may come from several policy versions (exchange column token_policy_versions). A token
    generated more than this many versions before the policy the trainer holds is MASKED out of the loss; one of
    another version within the bound is importance-weighted (algo.loss.tis_cap; with tis_cap null its pi_old stays
    the engine's logprob, so the loss's clipped ratio pi_theta / pi_behaviour corrects the drift). Why mask rather than weight everything: the ratio is clipped, so a token
    many versions old gets no gradient where it disagrees with the policy and a full one where it happens to agree;
    past a version or two the clipped surrogate no longer bounds the policy step it was built for. Tokens of one
    version (no partial rollouts) are unaffected."""
    optimizer: OptimizerConfig = OptimizerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    publish_keep_last: int = Field(2, ge=1)
    """Published policy versions kept for the rollout engines."""
    publish_max_shard_gb: float = Field(5.0, gt=0)
    """Size of one safetensors file of a published policy (Hugging Face's default sharding)."""
    weight_sync: Literal["files", "memory"] = "files"
    """How the rollout engines get each RL step's weights. `files`: a published Hugging Face directory per step
    (policy/v-N, what every engine can read, on any schedule). `memory`: trainer rank 0 keeps the newest policy in
    host memory and sends it to the engine workers over a torch.distributed (gloo) group per sync
    (trainer/weight_sender.py), bucket by bucket, loading overlapping receiving: no write and re-read of the whole
    model on shared storage per step (bench/weight_sync.py, docs/performance.md). Files are then published every
    `publish_every` steps (and at a stage's end) for eval, export, restarts and engines that cannot join, which
    fall back to the newest published version (said in the log and in `rstar-hpc run status`). Default `files`:
    the memory path runs end to end through the real roles (tests/integration/test_weight_sync_e2e.py), but it
    sends over gloo from host memory, one copy per receiving worker, which at 14B with many engines is slower than
    Lustre (docs/performance.md); NCCL is the next step."""
    publish_every: int = Field(1, ge=1)
    """RL steps between file publishes. 1 with `weight_sync: files` (the engines need every step's version);
    with `memory`, larger values spare the storage: the last step of a stage always publishes, and so does the
    end of SFT. The version numbers are run-global either way: a step offered only in memory takes a number too."""
    weight_sync_bucket_mb: int = Field(256, ge=1)
    """`memory` sync: size of one broadcast bucket. An engine loads bucket k while bucket k+1 is on the wire;
    each side holds two buckets at a time. Larger buckets mean fewer messages, smaller ones finer overlap."""
    weight_sync_timeout_s: float = Field(120.0, gt=0)
    """`memory` sync: how long the group of a sync session waits for every member to join, and for each
    bucket. An engine that does not make it in time falls back to the newest published files."""
    producers: list[str] = Field(default_factory=lambda: ["rollout"])
    """Trajectory producers whose commit records make an RL step complete (the rollout role writes as
    `rollout`)."""
    trajectory_timeout_s: float = Field(3600.0, gt=0)
    """How long an RL step waits for its trajectories while the rollout says nothing (its heartbeat) before failing
    with the missing producers named; a rollout at work (a long hard_subset stage in between) may take longer."""

    @model_validator(mode="after")
    def _knobs_agree(self) -> TrainerConfig:
        if self.virtual_pipeline_parallel_size is not None and self.pipeline_parallel_size == 1:
            raise ValueError(f"trainer.virtual_pipeline_parallel_size={self.virtual_pipeline_parallel_size} needs "
                             f"trainer.pipeline_parallel_size > 1; set it to null or raise pipeline_parallel_size")
        if self.weight_sync == "files" and self.publish_every != 1:
            raise ValueError(f"trainer.publish_every={self.publish_every} with trainer.weight_sync=files leaves the "
                             f"engines without the versions of the steps in between; set publish_every: 1 or "
                             f"weight_sync: memory")
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ValueError("trainer.sequence_parallel=true splits tokens over tensor-parallel ranks, but "
                             "trainer.tensor_parallel_size is 1; set it to null (or false) or raise the tp size")
        if self.recompute == "selective" and not self.recompute_modules:
            raise ValueError("trainer.recompute=selective with an empty trainer.recompute_modules recomputes nothing; "
                             "name modules (e.g. [core_attn]) or set recompute: none")
        return self

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def layout_problems(trainer: TrainerConfig, world_size: int, shape=None) -> list[str]:
    """What makes this layout impossible on `world_size` trainer ranks for a model of `shape` (a
    `models.shapes.ModelShape`, or None when unknown), each naming the key and the fix."""
    tp, pp, vpp = trainer.tensor_parallel_size, trainer.pipeline_parallel_size, trainer.virtual_pipeline_parallel_size
    mp, ep = tp * pp, trainer.expert_parallel_size
    out = []
    if ep > 1 and world_size % mp == 0 and (world_size // mp) % ep:
        out.append(f"trainer.expert_parallel_size={ep} does not divide the data-parallel size {world_size // mp} "
                   f"(trainer ranks {world_size} / (tp {tp} x pp {pp})), from which its ranks are taken; pick a "
                   f"divisor of it or change the number of trainer ranks")
    if world_size % mp:
        out.append(f"trainer ranks = launch.trainer.num_nodes x tasks_per_node = {world_size} is not a multiple of "
                   f"trainer.tensor_parallel_size ({tp}) x trainer.pipeline_parallel_size ({pp}) = {mp}; change the "
                   f"degrees or the number of trainer ranks")
    elif trainer.use_distributed_optimizer and world_size // mp < 2:
        out.append(f"trainer.use_distributed_optimizer=true shards the optimizer over data-parallel ranks, but "
                   f"{world_size} ranks / (tp {tp} x pp {pp}) = {world_size // mp} data-parallel rank; set it to "
                   f"false or add trainer ranks (launch.trainer)")
    if shape is None:
        return out
    if ep > 1 and not shape.is_moe:
        out.append(f"trainer.expert_parallel_size={ep}: the model ({shape.family}) has no experts; set it to 1")
    elif ep > 1 and shape.num_experts % ep:
        out.append(f"trainer.expert_parallel_size={ep} does not divide the model's {shape.num_experts} experts; pick "
                   f"a divisor of {shape.num_experts}")
    stages = pp * (vpp or 1)
    if shape.num_layers % stages:
        key = "pipeline_parallel_size x virtual_pipeline_parallel_size" if vpp else "pipeline_parallel_size"
        out.append(f"the model's {shape.num_layers} layers do not split evenly over trainer.{key} = {stages} "
                   f"stages; pick a divisor of {shape.num_layers}")
    width = ("moe_intermediate_size", shape.moe_intermediate_size) if shape.is_moe else \
        ("intermediate_size", shape.intermediate_size)
    for name, n in (("attention heads", shape.num_heads), ("key/value heads", shape.num_kv_heads), width):
        if n % tp:
            out.append(f"the model's {name} ({n}) do not split over trainer.tensor_parallel_size={tp}; pick a "
                       f"divisor of {n}")
    return out
