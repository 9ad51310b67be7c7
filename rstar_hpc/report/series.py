"""Which recorded key each figure of the report reads (the writers: rstar_hpc/trainer/job.py and trainer/rl.py with
algo/metrics.py for the trainer's record, rollout/scheduler.py's `publish_metrics` for the rollout's), and the
figures derived from several keys. Only these keys are kept while a file streams by.

X axis: one "RL step" axis across the run's RL stages, stage after stage. Trainer step k of a stage (1-based) is
the update on rollout step k - 1 of that stage (rollout steps are 0-based), so both land on x = offset + k.
"""
from __future__ import annotations

TRAINER_KEYS = {
    "mean_reward": "reward/mean",
    "pos_tool_error_kept": "roc/p_err_kept_pos",   # mean p_err of the positives RoC kept (GRPO keeps all)
    "pos_tool_error_all": "roc/p_err_all_pos",      # ... of every positive before down-sampling
    "num_trajectories": "roc/num_trajectories",     # sampled, over the step's groups
    "num_groups": "roc/num_groups",
    "num_kept": "roc/num_kept",                     # trained, over the groups that trained
    "groups_trained": "roc/groups_trained",
    "response_length": "response/length_mean(tokens)",
    # what the policy does, over every sampled trajectory, before selection (algo/metrics.py behaviour/*)
    "sampled_tool_error": "behaviour/tool_error_ratio",
    "sampled_pos_tool_error": "behaviour/tool_error_ratio_pos",
    "error_share": "behaviour/error_share",
    "pass_rate_clean": "behaviour/pass_rate_clean",              # trajectories that called the tool and never failed
    "pass_rate_after_error": "behaviour/pass_rate_after_error",  # ... that failed a call (recovered or not)
    # |log p_engine - log p_trainer| on the trainer's own version's tokens (trainer/off_policy.py)
    "logprob_mismatch_mean": "train/logprob_mismatch_mean",
    "logprob_mismatch_max": "train/logprob_mismatch_max",
    "time_read": "time/read(s)",
    "time_train": "time/train(s)",
    "time_publish": "time/publish(s)",
    "time_checkpoint": "time/checkpoint(s)",
    "time_step": "time/step(s)",
}
ROLLOUT_KEYS = {
    "rollout_mean_reward": "mean_reward",
    "tool_calls": "tool_calls_per_trajectory",
    "tool_error_ratio": "tool_error_ratio",
    "generation_wall": "generation_wall_s",
    "tool_wait": "tool_wait_s",        # summed over trajectories (they overlap), not wall time
    "generate": "generate_s",          # same, generation
    "reward_time": "reward_s",
    "tool_infra_failures": "tool_infra_failures",   # calls the sandbox's infrastructure lost (reruns' included)
    "infra_reruns": "infra_reruns",                 # trajectories run again from their prompt for such a loss
}
# the step time breakdown, bottom to top: (series, legend)
TIME_PARTS = [("time_generation", "generation"), ("time_tools", "tool calls"), ("reward_time", "reward"),
              ("time_train", "training"), ("time_publish", "policy publish"), ("time_checkpoint", "checkpoint")]


def derive(step: dict[str, float]) -> dict[str, float]:
    """Figures of one step computed from its recorded ones (missing inputs: the figure is left out)."""
    out = dict(step)
    if "mean_reward" not in out and "rollout_mean_reward" in out:
        out["mean_reward"] = out["rollout_mean_reward"]
    gen, tools, model = out.get("generation_wall"), out.get("tool_wait"), out.get("generate")
    if gen is not None:
        # trajectories overlap, so tool time is generation wall time x the share of trajectory time spent in tools
        share = tools / (tools + model) if tools is not None and model is not None and tools + model > 0 else 0.0
        out["time_tools"], out["time_generation"] = gen * share, gen * (1 - share)
    if "time_train" not in out and "time_step" in out:   # records written before time/train(s) existed
        rest = sum(out.get(k, 0.0) for k in ("time_read", "time_publish", "time_checkpoint"))
        out["time_train"] = max(0.0, out["time_step"] - rest)
    return out
