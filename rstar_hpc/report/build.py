"""build_report: load the run (and the runs it is compared with), draw the plots, write report.md and report.html.

Every plot and table tolerates what a run has not recorded (yet): it is skipped, and the report says why. The
only failure is a run with nothing at all to report (`NothingToReport`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.report.figures import PASS1_HEADER, fmt, headline, pass1_rows
from rstar_hpc.report.render import to_html, to_markdown
from rstar_hpc.report.rundata import RunData, load_run

# file, title, series [(name, legend)], y label, caption: the per-step curves (series.py: where each comes from)
LINE_PLOTS = [
    ("reward.png", "Mean reward", [("mean_reward", "")], "mean reward", "Mean reward per RL step"),
    ("positive_tool_error.png", "Tool-error ratio of positive trajectories",
     [("pos_tool_error_kept", "kept positives"), ("pos_tool_error_all", "all positives")], "mean p_err",
     ("Tool-error ratio (mean p_err) of the positive trajectories kept for training (solid: after RoC's selection) "
     "and of all positives (dashed); plain GRPO keeps all, so its two curves coincide")),
    ("sampled_tool_error.png", "Tool-error ratio of the sampled trajectories",
     [("sampled_tool_error", "all sampled"), ("sampled_pos_tool_error", "sampled positives")], "failed / calls",
     ("What the policy does: failed calls over calls, averaged over every trajectory the step sampled that made a "
      "call (solid), and over the positives among them (dashed), before any selection (the paper's Fig. 5 quantity)")),
    ("error_share.png", "Trajectories with a failed call", [("error_share", "")], "share of sampled",
     "Share of the sampled trajectories with at least one failed tool call"),
    ("response_length.png", "Response length", [("response_length", "")], "tokens (mean)",
     "Mean response length per RL step (tokens)"),
    ("tool_calls.png", "Tool calls per trajectory", [("tool_calls", "")], "calls", "Tool calls per trajectory"),
    ("sandbox_lost.png", "Tool calls the sandbox lost", [("tool_infra_failures", "calls lost"),
                                                         ("infra_reruns", "trajectories run again")], "per step",
     ("Tool calls the sandbox's infrastructure lost (a service died under them, or none answered within the "
      "client's wait), and the trajectories run again from their prompt for it (rollout.scheduler.infra_reruns): "
      "zero on a healthy run; a rise is an outage, not the policy")),
    ("logprob_mismatch.png", "Rollout-trainer log-probability mismatch",
     [("logprob_mismatch_mean", "mean"), ("logprob_mismatch_max", "max")], "|log p_engine - log p_trainer|",
     ("Mean (solid) and max (dashed) |log p_engine - log p_trainer| over the trained tokens the trainer's own policy "
      "version generated: numerics alone (kernels, precision, reductions); algo.tis.scope: all corrects it")),
]
HEADLINE_ROWS = [("RL steps", "rl_steps"), ("mean reward, first 10% of steps", "mean_reward_first"),
                 ("mean reward, last 10% of steps", "mean_reward_last"),
                 ("rollouts sampled per prompt", "sampled_per_group"),
                 ("rollouts trained per prompt that trained", "trained_per_group"),
                 ("tool-error ratio of kept positives (mean over steps)", "positive_tool_error_ratio"),
                 ("tool-error ratio of all positives (mean over steps)", "positive_tool_error_ratio_all"),
                 ("tool-error ratio of sampled trajectories, first quarter", "sampled_tool_error_ratio_first"),
                 ("tool-error ratio of sampled trajectories, last quarter", "sampled_tool_error_ratio_last"),
                 ("share of sampled with a failed call, first / last quarter",
                  ("error_share_first", "error_share_last")),
                 ("pass rate of sampled with no failed call / with one, first quarter",
                  ("pass_rate_clean_first", "pass_rate_after_error_first")),
                 ("response length (tokens), first quarter", "response_length_first"),
                 ("response length (tokens), last quarter", "response_length_last"),
                 ("tool calls per trajectory, last 10%", "tool_calls_per_trajectory_last"),
                 ("trainer step time (s, mean)", "step_time_mean_s")]


class NothingToReport(Exception):
    """The run has no metrics and no eval results."""


@dataclass
class Report:
    out: Path
    markdown: Path
    html: Path
    plots: list[Path] = field(default_factory=list)
    headline: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def build_report(run: RunPaths, *, label: str | None = None, compare: list[tuple[str, RunPaths]] = (),
                 out: Path | None = None) -> Report:
    runs = [load_run(run, label or run.name)] + [load_run(p, lab) for lab, p in compare]
    if runs[0].empty:
        raise NothingToReport(
            f"run {run.dir} has nothing to report yet: no records in {run.dir / 'metrics'}/"
            f"{{trainer,rollout}}.jsonl and no {run.dir / 'eval'}/<stage>/results.json. Has the run started "
            f"(rstar-hpc run status {run.dir})? Or is this the wrong directory?")
    out = Path(out) if out is not None else run.report_dir
    out.mkdir(parents=True, exist_ok=True)
    notes = [n for r in runs for n in r.notes]
    notes += [f"compared run {r.label} ({r.paths.dir}) has no metrics or eval results" for r in runs[1:] if r.empty]
    figures = _draw(runs, out, notes)
    heads = [headline(r) for r in runs]
    md, page = out / "report.md", out / "report.html"
    doc = _document(runs, heads, figures, notes)
    md.write_text(to_markdown(doc))
    page.write_text(to_html(doc, f"rstar-hpc report: {runs[0].label}"))
    head = {**heads[0], "report": str(md), "html": str(page), "plots": [str(out / f) for f, _ in figures],
            "compare": {h["label"]: h for h in heads[1:]}, "notes": notes}
    return Report(out, md, page, [out / f for f, _ in figures], head, notes)


def _draw(runs: list[RunData], out: Path, notes: list[str]) -> list[tuple[str, str]]:
    from rstar_hpc.report import plots  # matplotlib: only when a report is drawn

    jobs = [(f, cap, lambda p, s=series, t=title, y=ylabel: plots.line_plot(runs, s, t, y, p))
            for f, title, series, ylabel, cap in LINE_PLOTS]
    jobs.insert(1, ("pass1.png", "pass@1 ± standard error at each eval stage",
                    lambda p: plots.pass1_plot(runs, p)))
    if any(r.series.get("val_pass1") for r in runs):   # only runs with stages[].val_every
        jobs.insert(2, ("validation.png", "pass@1 on the held-out validation files (stages[].val_data, mean over "
                        "files) at each validation point", lambda p: plots.line_plot(
                            runs, [("val_pass1", "")], "Validation pass@1", "pass@1 (avg@k)", p)))
    jobs.append(("step_time.png", ("Step time breakdown (rollout: generation, tool calls, reward; trainer: "
                 "training, policy publish, checkpoint)"), lambda p: plots.time_plot(runs, p)))
    figures = []
    for name, caption, draw in jobs:
        path = out / name
        path.unlink(missing_ok=True)   # a stale plot of an earlier report must not pass for this one's
        note = draw(path)
        if note:
            notes.append(note)
        if path.exists():
            figures.append((name, caption))
    return figures


def _document(runs: list[RunData], heads: list[dict], figures: list[tuple[str, str]], notes: list[str]) -> list:
    main = runs[0]
    compared = "; ".join(f"{r.label}: {r.paths.dir}" for r in runs[1:])
    doc: list = [("h1", f"Run report: {main.label}"),
                 ("p", f"Run directory {main.paths.dir}" + (f"; compared with {compared}" if compared else "") +
                  f". Written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `rstar-hpc report`."),
                 ("h2", "Headline"),
                 ("table", ["figure"] + [r.label for r in runs],
                  [[name] + [_cell(h, key) for h in heads] for name, key in HEADLINE_ROWS] +
                  [[f"pass@1 {lab} ± stderr"] + [_pm(h, lab) for h in heads] for lab in ("base", "sft", "rl")]),
                 ("h2", "pass@1 of the base, SFT and RL models")]
    rows = pass1_rows(runs)
    doc.append(("table", PASS1_HEADER, rows) if rows else
               ("p", "No eval results yet (eval/<stage>/results.json, written by an eval stage)."))
    val = [[r.label, v["stage"], str(v["step"]), name, fmt(m.get("pass1")), fmt(m.get("pass1_stderr")), fmt(v["k"])]
           for r in runs for v in r.validation for name, m in v["benchmarks"].items()]
    if val:
        doc += [("h2", "Validation during RL (stages[].val_every)"),
                ("table", ["run", "stage", "step", "file", "pass@1", "± stderr", "k"], val)]
    doc.append(("h2", "Plots"))
    doc += [("figure", name, caption) for name, caption in figures]
    if notes:
        doc += [("h2", "Not shown"), ("list", notes)]
    doc.append(("p", f"The same metrics, live: tensorboard --logdir {main.paths.tb_root}"))
    return doc


def _cell(h: dict, key: str | tuple[str, ...]) -> str:
    """A headline figure, or several side by side ("a / b")."""
    return fmt(h[key]) if isinstance(key, str) else " / ".join(fmt(h[k]) for k in key)


def _pm(h: dict, label: str) -> str:
    if h[f"pass1_{label}"] is None:
        return "-"
    return f"{fmt(h[f'pass1_{label}'])} ± {fmt(h[f'pass1_{label}_stderr'])} ({h[f'pass1_{label}_stage']})"
