"""The trainer's measured GPU figures as data: docs/gpu-figures/*.json, one file per `scripts/gpu-check.sh` run
(written by it), read by the planner for its per-card MFU.

A file is gpu-check's JSON: `date`, `commit`, `card` (a key of trainer/flops.py's PEAK_TFLOPS: h200, h100, ...),
`device`, `torch`, `cuda`, `driver`, `seq_len`, `peak_tflops`, and per model (`models`): its `shape`, `params` and
per recompute setting (`none`, `selective`) the SFT and RL steps' `tokens_per_s` and `mfu`, `peak_mem_gib` and the
plan's `planned_gib`; `repeats` may hold further runs of a model, in the same form. The planner's MFU for a card is
the newest file's (by date, then name) RL step with selective recompute (the recipe's setting: pi_old recomputed,
the update, AdamW) of its largest model, the mean over its runs.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from rstar_hpc.assets import gpu_figures_dir


def figure_files(card: str, folder: Path | None = None) -> list[tuple[Path, dict]]:
    """Every figures file of `card`, oldest first; an unreadable file is skipped (it cannot be the planner's)."""
    found = []
    for path in sorted((folder or gpu_figures_dir()).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("card") == card and data.get("models"):
            found.append((path, data))
    return sorted(found, key=lambda f: (str(f[1].get("date", "")), f[0].name))


def measured_mfu(card: str, folder: Path | None = None) -> tuple[float, str] | None:
    """(the RL step's MFU with selective recompute, where it comes from) of the newest file of `card` that has one;
    None without any."""
    def rl_mfu(run: dict) -> float | None:
        return ((run or {}).get("selective") or {}).get("rl", {}).get("mfu")

    for path, data in reversed(figure_files(card, folder)):
        measured = [(m.get("params", 0), name) for name, m in data["models"].items() if rl_mfu(m)]
        if measured:
            model = max(measured)[1]
            runs = [rl_mfu(data["models"][model])] + [x for x in [rl_mfu((data.get("repeats") or {}).get(model))] if x]
            return (sum(runs) / len(runs), f"{_shown(path)}, {data.get('date', 'no date')}: {model} RL step, selective "
                    f"recompute{f', mean of {len(runs)} runs' if len(runs) > 1 else ''}")
    return None


def _shown(path: Path) -> str:
    """The path from the checkout's root where it is in one (docs/gpu-figures/...), else as it is."""
    parts = path.parts
    return "/".join(parts[parts.index("docs"):]) if "docs" in parts else str(path)


def commit() -> str | None:
    """The checkout's commit, `-dirty` with uncommitted changes to tracked files; None outside a git checkout
    (a copy of the tree on a device machine: pass gpu-check --commit)."""
    def git(*args: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                                  cwd=Path(__file__).resolve().parent)
        except (OSError, subprocess.SubprocessError):
            return None

    head = git("rev-parse", "--short=12", "HEAD")
    if head is None or head.returncode != 0:
        return None
    diff = git("diff", "--quiet", "HEAD", "--")   # reads only: no index refresh written
    return head.stdout.strip() + ("-dirty" if diff is not None and diff.returncode == 1 else "")


def write_figures(figures: dict, folder: Path | None = None) -> Path:
    """Write one gpu-check run's figures as DATE-CARD-COMMIT.json in `folder` (docs/gpu-figures)."""
    folder = folder or gpu_figures_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{figures['date']}-{figures.get('card') or 'unknown'}-{figures.get('commit') or 'nocommit'}.json"
    path.write_text(json.dumps(figures, indent=1) + "\n")
    return path
