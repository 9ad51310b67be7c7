"""The plan as text: the rates' source, each mode at its recommended split, per stage, and the recipe's total
beside the paper's."""
from __future__ import annotations

from rstar_hpc.planner.model import MODES


def _pct(v: float) -> str:
    return f"{100 * v:.0f}%"


def format_run_plan(p: dict) -> str:
    r = p["rates"]
    active = p.get("active_parameters", p["parameters"])
    lines = [f"plan of {p['config']}: {p['model']}, {p['parameters'] / 1e9:.2f} B parameters"
             + (f" ({active / 1e9:.2f} B active)" if active != p["parameters"] else ""),
             f"rates: {r['source']}; {r['gpu']} ({r['peak_tflops']:g} TFLOPS, {r['hbm_tbs']:g} TB/s, "
             f"{r['memory_gb']:g} GB), MFU {r['mfu']:.3g} ({r['mfu_source']}), sync {r['sync_gbs']:.3g} GB/s, checkpoint "
             f"{r['ckpt_gbs']:.3g} GB/s" + (f", decode {r['decode_tok_s']:.0f} tok/s per engine (measured)"
                                            if r.get("decode_tok_s") else ""),
             f"{p['nodes']} GPU nodes x {p['gpus_per_node']} devices; configured split "
             f"{p['configured_split']['trainer_nodes']} trainer + {p['configured_split']['rollout_nodes']} rollout", ""]
    head = f"{'stage':<10}{'steps':>6}{'gen s':>9}{'tool s':>8}{'train s':>9}{'sync s':>8}{'ckpt s':>8}" \
           f"{'handoff s':>10}{'step s':>9}{'GPU-h/step':>11}{'idle trainer':>13}{'idle rollout':>13}"
    for mode in MODES:
        m, split = p[mode], p[mode]["recommended_split"]
        lines += [f"{mode}: recommended split {split['trainer_nodes']} trainer + {split['rollout_nodes']} rollout "
                  f"nodes: {m['step_s']:.1f} s/step, {m['gpu_hours_per_step']:.3g} GPU-h/step, "
                  f"{m['gpu_hours_total']:.6g} GPU-h over {sum(s['steps'] for s in m['stages'])} rl steps; idle: "
                  f"trainer {_pct(m['idle_fraction']['trainer'])}, rollout {_pct(m['idle_fraction']['rollout'])}",
                  "  " + head]
        lines += [f"  {s['stage']:<10}{s['steps']:>6}{s['generation_s']:>9.1f}{s['tool_s']:>8.1f}"
                  f"{s['training_s']:>9.1f}{s['sync_s']:>8.1f}{s['checkpoint_s']:>8.1f}{s['handoff_s']:>10.2f}"
                  f"{s['step_s']:>9.1f}"
                  f"{s['gpu_hours_per_step']:>11.3g}{_pct(s['idle_fraction']['trainer']):>13}"
                  f"{_pct(s['idle_fraction']['rollout']):>13}" for s in m["stages"]]
        lines.append("")
    paper = p["paper"]
    lines.append(f"overlap / on_policy GPU-hours per step: {p['overlap_vs_on_policy']:.2f}")
    lines.append(f"the paper: {paper['gpus']} {paper['gpu']} x {paper['days']:g} days over {paper['rl_steps']} rl steps "
                 f"= {paper['gpu_hours']:.0f} GPU-h ({paper['gpu_hours_per_step']:.1f} per step); this plan: "
                 f"on_policy {p['on_policy']['gpu_hours_total']:.0f}, overlap {p['overlap']['gpu_hours_total']:.0f} "
                 f"GPU-h over {p['on_policy']['stages'] and sum(s['steps'] for s in p['on_policy']['stages'])} steps")
    if "measured_step_s" in p:
        lines.append(f"from the run: predicted {p['measured_mode']} {p['predicted_step_s']:.2f} s/step at its own split, measured "
                     f"{p['measured_step_s']:.2f} s/step (mean of {p['measured_steps']} rl steps; per stage: "
                     + ", ".join(f"{k} {v:.2f}" for k, v in p["measured_stage_step_s"].items()) + ")")
    return "\n".join(lines)
