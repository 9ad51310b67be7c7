"""`rstar-hpc demo`: the rStar2 recipe in miniature on this machine, through `rstar-hpc launch` on the local Slurm
cluster, with a report of what was learned.

    1. SFT run       the config's stages up to its first rl stage (base eval, SFT cold start, SFT eval)
    2. RL runs       the remaining stages (rl with growing length, hard subset, rl with the optimizer reset, eval),
                     each starting from the SFT run's final policy, same seed and budget, one per mode:
                     RoC (the paper's GRPO-RoC: sample 2G, keep G, weighted positive selection), GRPO (the paper's
                     baseline: sample G, train G), Random (sample 2G, keep G uniformly: RoC's oversampling without
                     its selection), RoC-topk (the public code's lowest-penalty positive selection), RoC-overlap
                     (RoC, one-step off-policy: rollout.scheduler.mode overlap; not in the default set)
    3. the report    `rstar-hpc report` of the RoC run with the others compared: RUN/report/report.{md,html} + PNGs
The last stdout line is one JSON object of the figures (pass@1 of base, SFT and RL with standard errors, the
tool-error ratio of the positives each mode trained on, the rollouts each mode sampled and trained per prompt,
each RL run's wall time and its roles' idle fractions over its rl steps, wall time, the report's path), and under
`modes`, per mode, what its policy did over the first and the last quarter of its RL steps (BEHAVIOUR: the
tool-error ratio and response length of every sampled trajectory, the share with a failed call) with its pass@1.
`rstar-hpc demo demo-noisy` (configs/demo-noisy.yaml) is the variant where the policy errs often at first.
"""
from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import click
import yaml

from rstar_hpc.cli.exit_codes import EXIT_FAILED

DEMO_CONFIG = "demo"
# per mode in the summary's `modes`: report headline keys, each averaged over the first / last quarter of RL steps
BEHAVIOUR = ("sampled_tool_error_ratio_first", "sampled_tool_error_ratio_last", "response_length_first",
             "response_length_last", "error_share_first", "error_share_last", "pass_rate_clean_first",
             "pass_rate_after_error_first")
# label -> (summary key, overrides of the RL run)
MODES = {
    "RoC": ("roc", []),
    "GRPO": ("grpo", ["algo.roc.mode=grpo"]),
    "Random": ("random", ["algo.roc.mode=random"]),
    "RoC-topk": ("topk", ["algo.roc.positive_selection=topk"]),
    "RoC-overlap": ("overlap", ["rollout.scheduler.mode=overlap"]),
}


def _say(text: str) -> None:
    click.echo(click.style(text, bold=True), err=True)


def split_stages(cfg) -> tuple[list, list]:
    """(the SFT run's stages, the RL runs' stages): everything before the first rl stage, and the rest."""
    first_rl = next((i for i, s in enumerate(cfg.stages) if s.kind == "rl"), None)
    if first_rl is None or not any(s.kind == "sft" for s in cfg.stages[:first_rl]):
        raise click.UsageError("the demo needs a config with an sft stage and, after it, rl stages (configs/demo.yaml)")
    return cfg.stages[:first_rl], cfg.stages[first_rl:]


def derive(cfg, name: str, stages: list, overrides: list[str], folder: Path):
    """`cfg` as run `name` with only `stages`, plus `overrides`: written beside the runs, then loaded (validated)."""
    from rstar_hpc.config import load_config
    from rstar_hpc.config.loader import dump_config

    d = yaml.safe_load(dump_config(cfg))
    d["run"]["name"] = name
    d["stages"] = [s.model_dump(mode="json", exclude_none=True, exclude_defaults=True) | {"name": s.name, "kind": s.kind}
                   for s in stages]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return load_config(str(path), overrides)


def _launch(cfg, env: dict, timeout_s: float) -> dict:
    """Launch `cfg`'s run and follow it to its end; where its time went (report/phases.py)."""
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.launch.launcher import launch_run
    from rstar_hpc.report.phases import run_phases

    t0 = time.time()
    info = launch_run(cfg, "sbatch", wait=True, env=env, timeout_s=timeout_s, poll_s=1.0,
                      echo=lambda line: click.echo(f"      {line}", err=True))
    status = info.get("status")
    if status is not None and not status["done"]:
        click.echo("run {} stopped before it was done:\n  {}".format(cfg.run.name, "\n  ".join(status["problems"])),
                   err=True)
        sys.exit(EXIT_FAILED)
    return run_phases(RunPaths(cfg.run.dir), [s.name for s in cfg.stages], submitted_at=t0, ended_at=time.time())


@click.command("demo")
@click.argument("config", default=DEMO_CONFIG)
@click.argument("overrides", nargs=-1)
@click.option("--modes", default=",".join(m for m in MODES if m != "RoC-overlap"), show_default=True,
              help=f"RL runs to make from the SFT policy, comma-separated, of: {', '.join(MODES)}.")
@click.option("--state-dir", type=click.Path(file_okay=False), default=None, help="Local cluster state directory.")
@click.option("--keep-cluster", is_flag=True, help="Leave a cluster this demo started running afterwards.")
@click.option("--timeout-s", default=1800, show_default=True, help="Give up on a run after this long.")
def command(config: str, overrides: tuple[str, ...], modes: str, state_dir, keep_cluster: bool, timeout_s: int) -> None:
    """Train a tiny model with the rStar2 recipe through the local Slurm cluster and report what it learned.

    CONFIG (default: configs/demo.yaml) needs an sft stage before its rl stages; OVERRIDES are dotted key=value
    pairs (e.g. run.seed=1). A cluster that was already up is left up; one the demo started is stopped at the end
    (unless --keep-cluster).
    """
    from rstar_hpc.cluster import LocalCluster
    from rstar_hpc.config import load_config
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.models.resolve import resolve_model

    t0 = time.monotonic()
    cfg = load_config(config, list(overrides))     # a bad config fails here, before anything starts
    labels = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = [m for m in labels if m not in MODES]
    if unknown or "RoC" not in labels:
        raise click.BadParameter(f"modes must include RoC and be among {', '.join(MODES)}; got {modes!r}",
                                 param_hint="--modes")
    sft_stages, rl_stages = split_stages(cfg)
    base = f"{cfg.run.name}-s{cfg.run.seed}"
    configs = cfg.run.root_dir / f"{base}-configs"

    _say("[1/4] local Slurm cluster")
    phases: dict = {}
    with _timed(phases, "cluster"):
        cluster = LocalCluster(state_dir)
        was_up = cluster.is_up()
        cluster.up()
    env = {**cluster.env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    click.echo(f"      {'already up' if was_up else 'started'}: nodes {', '.join(cluster.node_names)}", err=True)
    try:
        _say(f"[2/4] SFT run: {', '.join(s.name for s in sft_stages)}")
        sft = derive(cfg, f"{base}-sft", sft_stages, [], configs)
        with _timed(phases, "model"):
            resolve_model(sft)   # the tiny model, built once (the launch's preflight finds it)
        phases["sft_run"] = _launch(sft, env, timeout_s)
        latest = RunPaths(sft.run.dir).policies().latest()
        if latest is None:
            raise click.ClickException(f"the SFT run {sft.run.dir} published no policy")
        runs = {}
        for i, label in enumerate(labels):
            _say(f"[3/4] RL run {i + 1}/{len(labels)} ({label}): {', '.join(s.name for s in rl_stages)}")
            name = f"{base}-{label.lower()}"
            rl = derive(cfg, name, rl_stages, [*MODES[label][1], f"model.path={latest[1]}"], configs)
            phases.setdefault("rl_runs", {})[MODES[label][0]] = _launch(rl, env, timeout_s)
            runs[label] = RunPaths(rl.run.dir)
        _say("[4/4] report")
        with _timed(phases, "report"):
            summary = _report(RunPaths(sft.run.dir), runs,
                              timing=_timing(runs, phases["rl_runs"], {s.name for s in rl_stages if s.kind == "rl"}))
    finally:
        if not was_up and not keep_cluster:
            cluster.down()
            click.echo("local cluster stopped (it was started by this demo; --keep-cluster keeps it)", err=True)
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    summary["phases"] = phases
    _print_phases(phases, summary["wall_s"])
    click.echo(json.dumps(summary))


@contextmanager
def _timed(phases: dict, name: str):
    t0 = time.monotonic()
    try:
        yield
    finally:
        phases[name] = round(time.monotonic() - t0, 1)


def _print_phases(phases: dict, wall_s: float) -> None:
    """The demo's time by phase, each run's by stage (report/phases.py): the next slowdown shows in its row."""
    from rstar_hpc.report.phases import phase_line

    rows = [("cluster start", phases.get("cluster"), ""), ("model build", phases.get("model"), "")]
    if "sft_run" in phases:
        rows.append(("SFT run", phases["sft_run"]["wall"], phase_line(phases["sft_run"])))
    for label, (key, _) in MODES.items():
        run = phases.get("rl_runs", {}).get(key)
        if run is not None:
            rows.append((f"RL {label}", run["wall"], phase_line(run)))
    rows += [("report", phases.get("report"), ""), ("total", wall_s, "")]
    click.echo("      wall time by phase (s; a run's stages: from the previous stage's end to its own):", err=True)
    for name, secs, detail in rows:
        click.echo(f"        {name:<14} {'-' if secs is None else f'{secs:7.1f}'}   {detail}".rstrip(), err=True)


def _timing(runs: dict, rl_phases: dict, rl_stages: set[str]) -> dict:
    """Each RL run's wall seconds and its roles' idle fractions over all its rl steps (its own metrics)."""
    from rstar_hpc.launch.status import rollout_idle, trainer_idle

    out = {}
    for label, paths in runs.items():
        t, r = trainer_idle(paths.dir, last=None), rollout_idle(paths.dir, rl_stages, last=None)
        out[MODES[label][0]] = {"wall_s": rl_phases[MODES[label][0]]["wall"],
                                "idle_fraction": {"trainer": t and t["idle_fraction"], "rollout": r and r["idle_fraction"]}}
    return out


def _secs(s: float | None) -> str:
    return "done before this demo" if s is None else f"{s:.0f}s"


def _report(sft, runs: dict, timing: dict | None = None) -> dict:
    from rstar_hpc.report.build import build_report
    from rstar_hpc.report.figures import fmt

    compare = [("SFT", sft)] + [(label, p) for label, p in runs.items() if label != "RoC"]
    report = build_report(runs["RoC"], label="RoC", compare=compare)
    head = report.headline
    sft_head = head["compare"]["SFT"]
    out = {"pass1_base": sft_head["pass1_base"], "pass1_base_stderr": sft_head["pass1_base_stderr"],
           "pass1_sft": sft_head["pass1_sft"], "pass1_sft_stderr": sft_head["pass1_sft_stderr"],
           "pass1_rl": head["pass1_rl"], "pass1_rl_stderr": head["pass1_rl_stderr"],
           "roc_positive_tool_error_ratio": head["positive_tool_error_ratio"]}
    out["sampled_per_group"], out["trained_per_group"], out["modes"] = {}, {}, {}
    for label in runs:
        key, mine = MODES[label][0], head if label == "RoC" else head["compare"][label]
        out["modes"][key] = {"pass1": _round(mine["pass1_rl"]), "pass1_stderr": _round(mine["pass1_rl_stderr"]),
                             **{k: _round(mine[k]) for k in BEHAVIOUR}}
        if label != "RoC":
            out[f"pass1_{key}"], out[f"pass1_{key}_stderr"] = mine["pass1_rl"], mine["pass1_rl_stderr"]
            out[f"{key}_positive_tool_error_ratio"] = mine["positive_tool_error_ratio"]
        out["sampled_per_group"][key] = _round(mine["sampled_per_group"])
        out["trained_per_group"][key] = _round(mine["trained_per_group"])
    if timing:
        out["rl_runs"] = timing
        click.echo("      RL wall and idle (trainer / rollout): " + ", ".join(
            f"{label} {_secs(timing[MODES[label][0]]['wall_s'])}, "
            + " / ".join("-" if v is None else f"{v:.0%}" for v in timing[MODES[label][0]]["idle_fraction"].values())
            for label in runs), err=True)
    out.update(report=str(report.markdown), html=str(report.html),
               runs={"SFT": str(sft.dir), **{k: str(p.dir) for k, p in runs.items()}})
    click.echo(f"      pass@1: base {_pm(out, 'base')}, SFT {_pm(out, 'sft')}, RL (GRPO-RoC) {_pm(out, 'rl')}", err=True)
    click.echo("      rollouts per prompt, sampled / trained: " + ", ".join(
        f"{label} {out['sampled_per_group'][MODES[label][0]]} / {out['trained_per_group'][MODES[label][0]]}"
        for label in runs), err=True)
    ends = [(label, out["modes"][MODES[label][0]]) for label in runs]
    click.echo("      sampled tool-error ratio, first -> last quarter: " + ", ".join(
        f"{label} {fmt(m['sampled_tool_error_ratio_first'])} -> {fmt(m['sampled_tool_error_ratio_last'])}"
        for label, m in ends), err=True)
    click.echo(f"      report: {report.html}", err=True)
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _pm(out: dict, key: str) -> str:
    p, e = out.get(f"pass1_{key}"), out.get(f"pass1_{key}_stderr")
    return "-" if p is None else f"{p:.3f} ± {e:.3f}" if e is not None else f"{p:.3f}"
