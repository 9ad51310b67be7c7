"""The trainer role: a Qwen3 policy in Megatron-core, trained by SFT or GRPO-RoC, checkpointed and published.

    model.py       the policy as a megatron-core GPTModel (TE spec on GPU, SDPA spec on CPU), init_distributed
    hf_convert.py  Hugging Face <-> Megatron weights, exact both ways (load_hf_checkpoint, export_hf_checkpoint)
    step.py        MicroBatch, pack, train_step (global token normalisation), AdamW and the lr schedules
    sft.py         SFT data (rStar2 chat JSONL, assistant-only loss) and its stage data for the role
    rl.py          the RL step (RoC, group advantages, pi_old recompute, GRPO-RoC loss) and TrajectorySource
    checkpoint.py  distributed checkpoints with an atomic commit, resume, optimizer reset, SaveOnSignal
    publish.py     policy versions for the rollout engines (HF safetensors under policy/, `latest`)
    job.py         the role's job: run(cfg, stage), called by `rstar-hpc train` (jobs/trainer.py)
"""
