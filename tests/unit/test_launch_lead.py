"""`launch.signal_lead_s` against a step plus a checkpoint save (rstar_hpc/launch/lead.py): measured from a run's
trainer metrics, planned from the planner for configs/qwen3-14b.yaml, shown by `launch --dry-run` and `run status`."""
from __future__ import annotations

import json
import subprocess
import sys

from rstar_hpc.config import load_config
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.launch.lead import lead_warning
from rstar_hpc.launch.status import run_status


def _metrics(run_dir, rows: list[dict]) -> None:
    (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics" / "trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _row(step: int, step_s: float, read_s: float = 0.0, **extra) -> dict:
    return {"stage": "rl", "step": step, "time/step(s)": step_s, "time/read(s)": read_s, **extra}


def test_measured_step_and_save_over_the_lead_are_named(tmp_path):
    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}", "launch.signal_lead_s=60"])
    run = tmp_path / "run"
    # steps of 40 s, 15 of them waiting for the rollout (a USR2 ends that wait): 25 s of work; saves of 50 s
    _metrics(run, [_row(1, 40.0, 15.0), _row(2, 90.0, 15.0, **{"time/checkpoint(s)": 50.0}), _row(3, 40.0, 15.0)])
    found = lead_warning(cfg, run, plan=False)
    assert found is not None and found["source"] == "measured"
    assert round(found["step_s"]) == 25 and round(found["checkpoint_s"]) == 50
    text = found["text"]
    assert "25 s" in text and "50 s" in text and "launch.signal_lead_s=60" in text, text
    assert "Raise launch.signal_lead_s" in text and "save less or faster" in text

    assert lead_warning(load_config("tiny-cpu", [f"run.root={tmp_path}", "launch.signal_lead_s=90"]), run,
                        plan=False) is None   # 75 s fit in 90
    _metrics(run, [_row(1, 10.0)])
    assert lead_warning(cfg, run, plan=False) is None   # no save measured yet: nothing to say


def test_an_async_save_counts_its_whole_write(tmp_path):
    """With async saves the loop blocks little (time/checkpoint(s)), but the save on USR2 waits for the write."""
    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}", "launch.signal_lead_s=60"])
    run = tmp_path / "run"
    _metrics(run, [_row(1, 31.0, **{"time/checkpoint(s)": 1.0}), _row(2, 30.0, **{"time/checkpoint_async(s)": 45.0})])
    found = lead_warning(cfg, run, plan=False)
    assert found is not None and round(found["step_s"]) == 30 and round(found["checkpoint_s"]) == 45


def test_run_status_lists_the_measured_warning(tmp_path):
    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}", "launch.signal_lead_s=60"])
    paths = RunPaths(cfg.run.dir)
    _metrics(paths.dir, [_row(1, 90.0, **{"time/checkpoint(s)": 50.0})])
    problems = run_status(cfg, paths, with_slurm=False)["problems"]
    assert any("launch.signal_lead_s=60" in p for p in problems), problems


def test_the_14b_recipe_is_planned_over_its_lead(tmp_path):
    """configs/qwen3-14b.yaml: the planner's rl-hard step (training + weight sync, ~630 s on its default rates)
    plus a checkpoint (~21 s) exceed signal_lead_s=300; launch --dry-run says so on stderr."""
    cfg = load_config("qwen3-14b", [f"run.root={tmp_path}", "model.path=/lustre/models/Qwen3-14B-Base"])
    found = lead_warning(cfg)
    assert found is not None and found["source"] == "planned"
    assert found["step_s"] + found["checkpoint_s"] > cfg.launch.signal_lead_s
    assert lead_warning(load_config("qwen3-14b", [f"run.root={tmp_path}", "model.path=/x",
                                                  f"launch.signal_lead_s={int(found['step_s'] + found['checkpoint_s']) + 5}"])) is None
    proc = subprocess.run([sys.executable, "-m", "rstar_hpc", "launch", "qwen3-14b", f"run.root={tmp_path}",
                           "model.path=/lustre/models/Qwen3-14B-Base", "--dry-run", "--json"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warning: a step" in proc.stderr and "launch.signal_lead_s=300" in proc.stderr, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1])["warnings"][0].startswith("warning: a step")
