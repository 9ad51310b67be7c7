"""Does a step plus a checkpoint fit `launch.signal_lead_s`? The warning of `rstar-hpc launch` and `run status`.

Slurm sends USR2 `launch.signal_lead_s` seconds before the time limit (`--signal=B:USR2@lead`); the trainer then
finishes the step it is in, saves, and the job requeues. If a step's work plus a save takes longer than the lead,
Slurm kills the job first and the steps since the last checkpoint are trained again. What counts:
  * the step's work: `time/step(s)` less its `time/read(s)` (a USR2 while waiting for the rollout stops the wait
    at once) and less its own `time/checkpoint(s)`; the longest stage's mean;
  * a save: the mean `time/checkpoint(s)` of the steps that saved, or with async saves the mean
    `time/checkpoint_async(s)` (the save on USR2 waits for its whole write) when that is longer.
Measured: from the run's own RUN/metrics/trainer.jsonl (the planner's reader). Planned (no trainer steps yet):
the planner's predicted training + weight sync of the slowest rl stage, and its checkpoint seconds
(rstar_hpc/planner: the documented default rates, so an estimate).
"""
from __future__ import annotations

import statistics
from pathlib import Path

KEY = "launch.signal_lead_s"


def measured(run_dir: Path) -> dict | None:
    """{"step_s", "checkpoint_s", "stage"} from the run's trainer metrics, or None without a step that saved."""
    from rstar_hpc.metrics_log import read_records
    from rstar_hpc.planner.measured import _last_by_step

    rows = _last_by_step(read_records(Path(run_dir) / "metrics" / "trainer.jsonl")).values()
    work: dict[str, list[float]] = {}
    saves, whole = [], []
    for r in rows:
        if not isinstance(r.get("time/step(s)"), (int, float)):
            continue
        ckpt = r.get("time/checkpoint(s)") or 0.0
        work.setdefault(r["stage"], []).append(r["time/step(s)"] - (r.get("time/read(s)") or 0.0) - ckpt)
        if ckpt:
            saves.append(ckpt)
        if r.get("time/checkpoint_async(s)"):
            whole.append(r["time/checkpoint_async(s)"])
    if not work or not (saves or whole):
        return None
    stage, step_s = max(((s, statistics.fmean(v)) for s, v in work.items()), key=lambda x: x[1])
    save_s = max(statistics.fmean(saves) if saves else 0.0, statistics.fmean(whole) if whole else 0.0)
    return {"source": "measured", "stage": stage, "step_s": step_s, "checkpoint_s": save_s}


def planned(cfg) -> dict | None:
    """The planner's step work (training + weight sync) of the slowest rl stage and its checkpoint seconds at the
    configured split, or None where the config cannot be planned (no rl stage, a layout the planner rejects)."""
    from rstar_hpc.planner.model import PlanError, make_run_plan
    from rstar_hpc.planner.rates import Rates

    try:
        plan = make_run_plan(cfg, Rates())
    except (PlanError, ValueError, FileNotFoundError, OSError):
        return None
    rows = plan["at_configured_split"]["stages"]
    if not rows:
        return None
    row = max(rows, key=lambda r: r["training_s"] + r["sync_s"])
    return {"source": "planned", "stage": row["stage"], "step_s": row["training_s"] + row["sync_s"],
            "checkpoint_s": row["checkpoint_s"]}


def lead_warning(cfg, run_dir: Path | None = None, *, plan: bool = True) -> dict | None:
    """The numbers and a warning text when step + save exceed `launch.signal_lead_s` (measured where the run has
    saved, else planned when `plan`), or None when they fit or nothing is known."""
    found = measured(run_dir) if run_dir is not None else None
    if found is None and plan:
        found = planned(cfg)
    if found is None:
        return None
    lead = cfg.launch.signal_lead_s
    total = found["step_s"] + found["checkpoint_s"]
    if total <= lead:
        return None
    how = "measured in this run" if found["source"] == "measured" else "planned (rstar-hpc plan's default rates)"
    found["lead_s"] = lead
    found["text"] = (
        f"a step ({found['step_s']:.0f} s, stage {found['stage']}) plus a checkpoint save ({found['checkpoint_s']:.0f} "
        f"s), {how}, take {total:.0f} s, more than {KEY}={lead}: at a time limit Slurm's USR2 comes too late for the "
        f"trainer to finish its step and save, and the steps since the last checkpoint are lost. Raise {KEY} to at "
        f"least {int(total * 1.2) + 1}, or save less or faster (trainer.checkpoint.save_every_steps does not shorten "
        f"the save on USR2; faster storage, or a shorter step does)")
    return found
