"""The report's PNG plots (matplotlib, Agg: no display on a login or compute node). Run i gets colour Ci on
every plot, so a compared run reads the same throughout. Each function returns None when it wrote its file, else
the reason it skipped (the report lists it)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")   # before pyplot: headless, whatever MPLBACKEND says
import matplotlib.pyplot as plt
import numpy as np

from rstar_hpc.report.rundata import RunData
from rstar_hpc.report.series import TIME_PARTS

STYLES = ["-", "--", ":", "-."]
MAX_BENCHMARKS = 6
SMOOTH_FROM = 30   # steps: from here on, the raw curve is drawn faint under a moving average


def _moving_average(y: np.ndarray) -> np.ndarray:
    w = max(3, len(y) // 25)
    c = np.cumsum(np.insert(y, 0, 0.0))
    out = np.empty_like(y)
    for i in range(len(y)):   # trailing window, shorter at the start
        lo = max(0, i + 1 - w)
        out[i] = (c[i + 1] - c[lo]) / (i + 1 - lo)
    return out


def _stage_marks(ax, run: RunData) -> None:
    """The first run's stage boundaries, dotted, named at the top."""
    for stage, x0 in run.offsets.items():
        if x0 > 0:
            ax.axvline(x0 + 0.5, color="0.6", linestyle=":", linewidth=0.8)
        ax.annotate(stage, (x0 + 0.5, 0.98), xycoords=("data", "axes fraction"), fontsize=7, color="0.4",
                    va="top")


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def line_plot(runs: list[RunData], series: list[tuple[str, str]], title: str, ylabel: str, path: Path) -> str | None:
    """Per-step curves of `series` [(name, legend suffix)] for every run, overlaid."""
    drawn = [(i, run, name, suffix) for i, run in enumerate(runs) for name, suffix in series if run.series.get(name)]
    if not drawn:
        return f"{title}: no run recorded {', '.join(name for name, _ in series)} (see rstar_hpc/report/series.py)"
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for i, run, name, suffix in drawn:
        x, y = (np.array(v, dtype=float) for v in zip(*run.series[name]))
        style = {"color": f"C{i % 10}", "linestyle": STYLES[[n for n, _ in series].index(name) % len(STYLES)]}
        label = f"{run.label} {suffix}".strip()
        if len(y) >= SMOOTH_FROM:
            ax.plot(x, y, alpha=0.25, linewidth=0.8, **style)
            ax.plot(x, _moving_average(y), label=f"{label} (moving avg)", **style)
        else:
            ax.plot(x, y, marker="o", markersize=3, label=label, **style)
    _stage_marks(ax, runs[0])
    ax.set(title=title, xlabel="RL step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)
    return None


def time_plot(runs: list[RunData], path: Path) -> str | None:
    """Step time breakdown, stacked, one panel per run that recorded timings."""
    timed = [(i, run) for i, run in enumerate(runs) if any(run.series.get(name) for name, _ in TIME_PARTS)]
    if not timed:
        return "step time breakdown: no timings recorded (time/*(s) of the trainer, *_s of the rollout)"
    fig, axes = plt.subplots(len(timed), 1, figsize=(7.5, 3.2 * len(timed)), sharex=True, squeeze=False)
    for ax, (i, run) in zip(axes[:, 0], timed):
        xs = sorted({x for name, _ in TIME_PARTS for x, _ in run.series.get(name, [])})
        parts = [dict(run.series.get(name, [])) for name, _ in TIME_PARTS]
        stacks = [[part.get(x, 0.0) for x in xs] for part in parts]
        ax.stackplot(xs, stacks, labels=[legend for _, legend in TIME_PARTS], step="mid", alpha=0.85)
        ax.set(title=f"{run.label}: step time", ylabel="seconds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))   # beside: stacks fill the panel
    axes[-1, 0].set_xlabel("RL step (tool calls: generation wall time x the trajectories' share of time in tools)")
    _save(fig, path)
    return None


def pass1_plot(runs: list[RunData], path: Path) -> str | None:
    """pass@1 ± stderr at each eval point, one panel per benchmark, runs overlaid."""
    stages: list[str] = []
    benches: list[str] = []
    for run in runs:
        for r in run.evals:
            stages += [r["stage"]] if r["stage"] not in stages else []
            benches += [b for b in r["benchmarks"] if b not in benches]
    if not stages:
        return "pass@1 at eval points: no eval/<stage>/results.json in any run"
    labels = {r["stage"]: (r.get("policy") or {}).get("label", "?") for run in runs for r in run.evals}
    # base, then SFT, then RL models left to right, whichever run (the RL run, or a compared SFT run) holds them
    order = {"base": 0, "sft": 1, "rl": 2}
    stages.sort(key=lambda s: order.get(labels[s], len(order)))
    shown = benches[:MAX_BENCHMARKS]
    fig, axes = plt.subplots(1, len(shown), figsize=(max(5.0, 3.6 * len(shown)), 3.8), squeeze=False)
    for ax, bench in zip(axes[0], shown):
        for i, run in enumerate(runs):
            pts = [(stages.index(r["stage"]), r["benchmarks"][bench]) for r in run.evals if bench in r["benchmarks"]
                   and isinstance(r["benchmarks"][bench].get("pass1"), (int, float))]
            if pts:
                ax.errorbar([p for p, _ in pts], [m["pass1"] for _, m in pts], capsize=3, marker="o",
                            yerr=[m.get("pass1_stderr") or 0.0 for _, m in pts], color=f"C{i % 10}", label=run.label)
        ax.set_xticks(range(len(stages)), [f"{s}\n({labels[s]})" for s in stages], fontsize=7)
        ax.set(title=f"{bench}: pass@1 ± stderr", ylabel="pass@1")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, path)
    left = benches[MAX_BENCHMARKS:]
    return f"pass@1 plot shows the first {MAX_BENCHMARKS} benchmarks; the table has {left} too" if left else None
