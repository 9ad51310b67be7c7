"""The trainer role: a Qwen3, Qwen2.5 or Llama 3 policy in Megatron-core, trained by SFT or GRPO-RoC,
checkpointed and published.

    arch.py        Arch: a checkpoint's numbers and family (qwen3, qwen2, llama), checked (no torch)
    model.py       the policy as megatron-core GPTModel chunks (TE spec on GPU, SDPA spec on CPU), its logits
    attention.py   attention over packed (THD) rows without Transformer Engine: SDPA/varlen, RoPE per sample
    parallel_dims.py  ParallelDims: tp x pp x dp (and vpp) and what the degrees must divide (no torch)
    parallel.py    the parallel world (init_distributed, destroy_distributed); Policy: this rank's chunks
                   (tp x pp x vpp) in megatron DDP; megatron's (distributed) optimizer
    packing.py     MicroBatch, token-budget packing (THD) and the padded baseline
    step.py        train_step through megatron's schedules (global token normalisation), the lr schedule
    host_device.py what lets megatron's CUDA-assuming training code run on gloo (the `cpu` backend)
    hf_convert.py  Hugging Face <-> Megatron weights, exact both ways, per pipeline stage (load, export)
    stage_data.py  StageData: what the role's loop asks of a stage's data, whatever its kind
    sft.py         SFT data (rStar2 chat JSONL, assistant-only loss) and its stage data for the role
    rl.py          the RL step (RoC, group advantages, pi_old recompute, GRPO-RoC loss) and TrajectorySource
    checkpoint.py  distributed checkpoints with an atomic commit, resume (also under another layout), the loop's
                   sync and async saves (Checkpointer), SaveOnSignal
    publish.py     policy versions for the rollout engines (HF safetensors under policy/, `latest`)
    heartbeat.py   rank 0 beats while a step makes progress (a long step is no hang)
    weight_sender.py  rank 0's in-memory offer of each policy to the engines (trainer.weight_sync: memory)
    memory_plan.py per-GPU memory and micro-batch plan of a layout (`rstar-hpc train --plan`), no torch
    flops.py       model FLOPs and MFU: the one count behind perf/mfu, gpu-check, the planner, the benches
    job.py         the role's job: run(cfg, stage), called by `rstar-hpc train` (jobs/trainer.py)
"""
