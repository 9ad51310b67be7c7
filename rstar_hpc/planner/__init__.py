"""The run planner: `rstar-hpc plan CONFIG [--from-run RUN] [--json]`.

For one RL step of each rl stage it predicts generation (engine_sim.py's engine model, long tail included),
tool time, training (the tokens trained x the model's FLOPs / an MFU), weight sync (bytes / bandwidth) and
checkpointing; then the step time, GPU-hours and each role's idle fraction in two modes, `on_policy` (today: the
trainer waits while the rollout generates and vice versa) and `overlap` (one-step off-policy: step N+1 generates
while step N trains), and the trainer/rollout node split that costs the fewest GPU-hours.

    rates.py       the rates (hardware figures, MFU, bandwidths, lengths) and where each default comes from
    gpu_figures.py docs/gpu-figures/: gpu-check's measured figures, written and read (the per-card MFU)
    engine_sim.py  the engine model: vLLM-like engines, KV-aware admission, preemption, tool turns (also what
                   bench/rollout_balance.py compares admission policies on)
    generation.py  one engine's generation time for a stage's step, simulated with engine_sim.py
    model.py       one step's phases, the two modes, the split search, the whole recipe
    measured.py    a finished run's own rates and measured step times (RUN/metrics/*.jsonl)
    render.py      the text report

Everything here is arithmetic and a simulation: no torch, no GPU, no Slurm.
"""
