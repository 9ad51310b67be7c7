"""`rstar-hpc plan CONFIG [overrides] [--from-run RUN] [--json]`: step time, GPU-hours and idle GPUs of a recipe's
RL steps, on-policy and overlapped, and the trainer/rollout node split that costs least (rstar_hpc/planner/)."""
from __future__ import annotations

import json

import click

from rstar_hpc.cli.exit_codes import EXIT_CONFIG, run_paths
from rstar_hpc.config.loader import DEFAULT_CONFIG


class PlanRefused(click.ClickException):
    exit_code = EXIT_CONFIG


@click.command("plan")
@click.argument("config", default=DEFAULT_CONFIG)
@click.argument("overrides", nargs=-1)
@click.option("--from-run", "from_run", default=None, help="Take the rates from this run's own metrics "
              "(RUN/metrics/*.jsonl) and show its predicted and measured mean step seconds side by side.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (modes on_policy and overlap).")
@click.option("--nodes", type=int, default=None, help="GPU nodes to split [the config's trainer + rollout nodes].")
@click.option("--stage", default=None, help="Plan this rl stage only [every rl stage].")
@click.option("--gpu", default=None, help="Hardware figures: h100 (default), h200, mi300x.")
@click.option("--peak-tflops", type=float, default=None, help="Dense bf16 TFLOPS per GPU [from --gpu].")
@click.option("--hbm-tbs", type=float, default=None, help="Memory bandwidth per GPU, TB/s [from --gpu].")
@click.option("--memory-gb", type=float, default=None, help="Memory per GPU, GB [from --gpu].")
@click.option("--mfu", type=float, default=None, help="Training model-FLOPs utilisation [the card's newest "
              "docs/gpu-figures file; else 0.35].")
@click.option("--sync-gbs", type=float, default=None, help="Policy trainer -> engines, GB/s end to end [1.0].")
@click.option("--ckpt-gbs", type=float, default=None, help="Checkpoint write, GB/s all trainer nodes [10].")
@click.option("--tool-latency-s", type=float, default=None, help="Seconds per tool call [0.3, the paper's].")
@click.option("--tool-calls", "tool_calls_per_traj", type=float, default=None, help="Tool calls per trajectory [2.75].")
@click.option("--response-tokens", multiple=True, metavar="STAGE=N",
              help="Mean response tokens of an rl stage [the paper's per stage]; repeatable.")
def command(config: str, overrides: tuple[str, ...], from_run: str | None, as_json: bool, nodes: int | None,
            stage: str | None, gpu: str | None, response_tokens: tuple[str, ...], **flags) -> None:
    """Predict one RL step of each rl stage (generation with its long tail, tools, training, weight sync,
    checkpoint), the step time, GPU-hours and each role's idle fraction on-policy (today) and overlapped (one-step
    off-policy), the node split that costs the fewest GPU-hours, and the recipe's total beside the paper's.

    Rates are the documented defaults (rstar_hpc/planner/rates.py), the flags, or with --from-run the run's own.
    Exit 3: a bad config, stage or rate, or a run without RL metrics; exit 4: no such run.
    """
    from rstar_hpc.config import load_config
    from rstar_hpc.planner.model import PlanError, make_run_plan
    from rstar_hpc.planner.rates import Rates
    from rstar_hpc.planner.render import format_run_plan

    cfg = load_config(config, overrides)
    try:
        rates = Rates().with_gpu(gpu) if gpu else Rates()
        rates = rates.override(**flags, response_tokens=_stage_tokens(response_tokens) or None)
        measured = {}
        if from_run is not None:
            from rstar_hpc.planner.measured import run_rates

            paths = run_paths(from_run)
            if not paths.config.is_file():
                raise PlanError(f"{paths.dir} has no config.yaml; --from-run needs a run that launch or a role started")
            run_cfg = load_config(str(paths.config))
            rates, measured = run_rates(paths.dir, run_cfg, rates)
            measured["measured_mode"] = run_cfg.rollout.scheduler.mode   # the run's own mode is what it measured
        result = make_run_plan(cfg, rates, nodes=nodes, stage=stage)
    except (PlanError, ValueError) as e:
        raise PlanRefused(str(e)) from None
    if measured:
        result.update(measured, predicted_step_s=result["at_configured_split"][measured["measured_mode"]]["step_s"])
    click.echo(json.dumps(result) if as_json else format_run_plan(result))


def _stage_tokens(items: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            sep = ""
        if not sep or not name:
            raise PlanRefused(f"--response-tokens {item}: expected STAGE=N (e.g. rl-8k=3000)")
    return out
