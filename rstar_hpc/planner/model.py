"""One RL step's phases, the two modes, the node split, and the whole recipe.

Per rl stage, at a split of T trainer and R rollout nodes (engines: R x launch.rollout.tasks_per_node, each of
rollout.engine.tensor_parallel_size GPUs):

  generation_s  one engine's share of the step's prompts_per_step x samples_per_prompt trajectories
                (generation.py; measured: its tokens / the run's decode tokens per second); tool calls included
  tool_s        what one trajectory waits on its tools (calls x latency): inside generation_s, not added
  training_s    model FLOPs (trainer/flops.py's model_flops: forward + backward, plus the pi_old forward: 4 passes;
                a mixture of experts' active parameters)
                of prompts_per_step x G x kept_fraction trajectories of prompt + mean response tokens, / (trainer
                GPUs x peak x MFU), or / the run's measured FLOP/s per trainer device
  sync_s        the bf16 policy (2 bytes per parameter) / sync_gbs
  checkpoint_s  14 bytes per parameter / ckpt_gbs, every trainer.checkpoint.save_every_steps steps
  handoff_s     how late the waiting role sees the other's hand-off (exchange/poll.py expected_lateness_s of its
                wait, rates.poll_s): on-policy, the trainer waits out generation and the rollout training + sync;
                in overlap, the faster role waits the difference. With --from-run of an on-policy run, the
                trainer's side is measured (handover_s: its read wait beyond the rollout's generation: the commit,
                its poll, reading and checking the shards)

  on_policy  step = generation + training + sync + max(0, checkpoint - generation) / save_every + handoff
             (the trainer checkpoints after it publishes, while the rollout generates the next step)
  overlap    step = max(generation, training + checkpoint / save_every) + sync + handoff

Idle fraction of a role: 1 - its GPUs' busy time / step (trainer: training; rollout: the engines' busy time, which
leaves out the tail's idle engines). GPU-hours per step: step x (trainer + rollout GPUs) / 3600; sandbox nodes are
CPU nodes and not counted. A CPU run (gpus_per_node 0) counts its tasks as devices.

The split search tries every T from 1 to N - 1 (N: the config's trainer + rollout nodes, or --nodes) whose trainer
layout divides its ranks (tp x pp) and fits the GPU's memory (trainer/plan.py), and picks, per mode, the one with
the fewest GPU-hours over the recipe's rl steps.
"""
from __future__ import annotations

import math
from functools import partial

from rstar_hpc.config.stages import StageConfig
from rstar_hpc.exchange.poll import expected_lateness_s
from rstar_hpc.models.shapes import model_shape
from rstar_hpc.planner import generation as gen
from rstar_hpc.planner.rates import PAPER, Rates
from rstar_hpc.trainer.flops import model_flops
from rstar_hpc.trainer.memory_plan import make_plan

CKPT_BYTES_PER_PARAM = 14   # bf16 weights + fp32 main weights + AdamW's two fp32 moments
MODES = ("on_policy", "overlap")


class PlanError(ValueError):
    """A plan that cannot be made; the message names the problem and the fix."""


def devices_per_node(role) -> int:
    return role.gpus_per_node or role.tasks_per_node


def rl_stages(cfg, only: str | None = None) -> list:
    stages = [s for s in cfg.stages if s.kind == "rl"]
    if only is not None:
        names = [s.name for s in cfg.stages]
        if only not in names:
            raise PlanError(f"--stage {only}: no such stage; stages: {', '.join(names)}")
        stages = [s for s in stages if s.name == only]
        if not stages:
            raise PlanError(f"--stage {only}: a {cfg.stage(only).kind} stage; the planner plans rl stages: "
                            f"{', '.join(s.name for s in cfg.stages if s.kind == 'rl') or 'none in this config'}")
    if not stages:
        raise PlanError("the config has no rl stage to plan; add one to `stages` (kind: rl)")
    return stages


def shape_of(cfg):
    """(shape, where it came from, parameters: every weight, both embeddings when untied)."""
    found = model_shape(cfg.model)
    if found is None:
        raise PlanError(f"model.path={cfg.model.path}: no config.json there and no published shape matches its "
                        f"name; copy the model's config.json there first")
    shape, source = found
    return shape, source, shape.num_params


def trainer_fits(cfg, trainer_nodes: int, rates: Rates) -> bool:
    """The trainer layout at this node count divides its ranks and (on GPUs) fits their memory."""
    t = cfg.trainer
    ranks = trainer_nodes * cfg.launch.trainer.tasks_per_node
    if ranks % (t.tensor_parallel_size * t.pipeline_parallel_size) or \
            (ranks // (t.tensor_parallel_size * t.pipeline_parallel_size)) % t.expert_parallel_size:
        return False
    if not cfg.launch.trainer.gpus_per_node:
        return True
    trial = cfg.model_copy(deep=True)
    trial.launch.trainer.num_nodes = trainer_nodes
    return make_plan(trial).total_gib * 2**30 <= rates.memory_gb * 1e9


def stage_step(cfg, stage_cfg: StageConfig, rl_index: int, split: tuple[int, int], rates: Rates, shape, n_params: int) -> dict:
    """The phases of one step of `stage` at split (trainer nodes, rollout nodes), and both modes' figures."""
    t_nodes, r_nodes = split
    lt, lr = cfg.launch.trainer, cfg.launch.rollout
    budget = stage_cfg.max_response_length or cfg.rollout.agent.max_response_length
    mean = rates.mean_response(stage_cfg, rl_index, budget)
    engines = r_nodes * lr.tasks_per_node
    per_engine = math.ceil(stage_cfg.prompts_per_step * cfg.algo.samples_per_prompt / engines)
    if rates.decode_tok_s:   # measured
        g = {"generation_s": per_engine * mean / rates.decode_tok_s, "idle_fraction": 0.0}
        g["busy_s"] = g["generation_s"]
    else:
        engine = gen.engine_constants(shape, n_params, rates, cfg.rollout.engine.tensor_parallel_size,
                                      cfg.rollout.engine.gpu_memory_utilization,
                                      cfg.rollout.scheduler.max_trajectories_per_engine)
        work = gen.Workload(per_engine, mean, budget, rates.prompt_tokens, stage_cfg.max_turns or cfg.rollout.agent.max_turns)
        g = gen.generation(engine, work, (rates.tool_latency_s, rates.tool_calls_per_traj, rates.tool_tokens))
    trained = round(stage_cfg.prompts_per_step * cfg.algo.trained_per_prompt * rates.kept_fraction)
    seqlens = [int(rates.prompt_tokens + mean)] * trained
    flops = model_flops(shape, seqlens, passes=4)[0] if trained else 0.0
    t_devices, r_devices = t_nodes * devices_per_node(lt), r_nodes * devices_per_node(lr)
    per_device = rates.train_flops or rates.peak_tflops * 1e12 * rates.mfu
    phases = {"generation_s": g["generation_s"], "tool_s": rates.tool_calls_per_traj * rates.tool_latency_s,
              "training_s": flops / (t_devices * per_device), "sync_s": 2.0 * n_params / (rates.sync_gbs * 1e9),
              "checkpoint_s": CKPT_BYTES_PER_PARAM * n_params / (rates.ckpt_gbs * 1e9),
              "trajectories_per_engine": per_engine, "mean_response_tokens": round(mean, 1),
              "trained_tokens": sum(seqlens), "tail_idle_fraction": round(g["idle_fraction"], 4)}
    every = cfg.trainer.checkpoint.save_every_steps
    gen_s, train_s, sync_s, ckpt_s = (phases[k] for k in ("generation_s", "training_s", "sync_s", "checkpoint_s"))
    late = partial(expected_lateness_s, max_s=rates.poll_s)
    busy_trainer = train_s + ckpt_s / every
    handover = rates.handover_s if rates.handover_s is not None else late(gen_s)   # measured: commit, poll, read
    handoff = {"on_policy": handover + late(train_s + sync_s), "overlap": late(abs(gen_s - busy_trainer))}
    steps = {"on_policy": gen_s + train_s + sync_s + max(0.0, ckpt_s - gen_s) / every + handoff["on_policy"],
             "overlap": max(gen_s, busy_trainer) + sync_s + handoff["overlap"]}
    out = {"stage": stage_cfg.name, "steps": stage_cfg.num_steps, **{k: _r(v) for k, v in phases.items()}}
    for mode, step in steps.items():
        out[mode] = {"step_s": _r(step), "handoff_s": _r(handoff[mode], 3), "gpu_hours_per_step": _r(step * (t_devices + r_devices) / 3600, 4),
                     "idle_fraction": {"trainer": _frac(1 - train_s / step), "rollout": _frac(1 - g["busy_s"] / step)}}
    return out


def _r(v, nd: int = 2):
    return round(v, nd) if isinstance(v, float) else v


def _frac(v: float) -> float:
    return round(min(1.0, max(0.0, v)), 4)


def plan_split(cfg, split: tuple[int, int], rates: Rates, shape, n_params: int, stages: list) -> dict:
    """Every rl stage at one split, and per mode the recipe's totals (means weighted by each stage's steps)."""
    index = {s.name: i for i, s in enumerate(s for s in cfg.stages if s.kind == "rl")}
    rows = [stage_step(cfg, s, index[s.name], split, rates, shape, n_params) for s in stages]
    steps = sum(r["steps"] for r in rows)
    out = {"split": {"trainer_nodes": split[0], "rollout_nodes": split[1]}, "stages": rows, "rl_steps": steps}
    for mode in MODES:
        total_h = sum(r[mode]["gpu_hours_per_step"] * r["steps"] for r in rows)
        out[mode] = {"step_s": _r(sum(r[mode]["step_s"] * r["steps"] for r in rows) / steps),
                     "gpu_hours_per_step": _r(total_h / steps, 4), "gpu_hours_total": _r(total_h, 1),
                     "gpu_hours_per_stage": {r["stage"]: _r(r[mode]["gpu_hours_per_step"] * r["steps"], 1)
                                             for r in rows},
                     "idle_fraction": {role: _frac(sum(r[mode]["idle_fraction"][role] * r[mode]["step_s"] * r["steps"]
                                                       for r in rows) / sum(r[mode]["step_s"] * r["steps"] for r in rows))
                                       for role in ("trainer", "rollout")}}
    return out


def make_run_plan(cfg, rates: Rates, *, nodes: int | None = None, stage: str | None = None) -> dict:
    """The plan: rates, the configured split's figures, and per mode its recommended split's (see the module doc)."""
    shape, source, n_params = shape_of(cfg)
    stages = rl_stages(cfg, stage)
    configured = (cfg.launch.trainer.num_nodes, cfg.launch.rollout.num_nodes)
    total = nodes or sum(configured)
    if total < 2:
        raise PlanError(f"--nodes {total}: the trainer and the rollout need a node each; give at least 2")
    if cfg.launch.trainer.gpus_per_node != cfg.launch.rollout.gpus_per_node:
        raise PlanError("launch.trainer.gpus_per_node and launch.rollout.gpus_per_node differ: the split search moves "
                        "nodes between the roles, so they must be the same kind of node")
    tried = {t: plan_split(cfg, (t, total - t), rates, shape, n_params, stages)
             for t in range(1, total) if trainer_fits(cfg, t, rates)}
    if not tried:
        raise PlanError(f"no split of {total} nodes fits the trainer's layout (tp x pp = "
                        f"{cfg.trainer.tensor_parallel_size} x {cfg.trainer.pipeline_parallel_size}, "
                        f"{rates.memory_gb:g} GB GPUs); give more --nodes or check `rstar-hpc train CONFIG --plan`")
    at_config = plan_split(cfg, configured, rates, shape, n_params, stages)
    out = {"config": cfg.run.name, "model": source, "parameters": n_params, "active_parameters": shape.active_params,
           "nodes": total,
           "gpus_per_node": devices_per_node(cfg.launch.rollout), "rates": rates.to_dict(),
           "configured_split": at_config["split"], "at_configured_split": at_config}
    for mode in MODES:
        best = min(tried.values(), key=lambda p: p[mode]["gpu_hours_total"])
        out[mode] = {**best[mode], "recommended_split": best["split"], "stages": [
            {k: v for k, v in row.items() if k not in MODES} | row[mode] for row in best["stages"]]}
    out["overlap_vs_on_policy"] = round(out["overlap"]["gpu_hours_per_step"] / out["on_policy"]["gpu_hours_per_step"], 4)
    out["splits"] = {t: {m: p[m]["gpu_hours_per_step"] for m in MODES} for t, p in tried.items()}
    out["paper"] = {k: _r(v, 2) if isinstance(v, float) else v for k, v in PAPER.items()}
    return out
