"""`rstar-hpc eval`: measure a policy the way the paper does (avg@k pass@1 and the rest, rstar_hpc/eval/) on
benchmark files, with the rollout role's machinery (engine ranks, KV-aware scheduler, sandbox pools).

It writes a run directory OUT (OUT/config.yaml: the given config with the policy as the model and one `eval` stage)
and runs it: here (`--launcher local`: a sandbox service and the rollout's ranks) or as Slurm jobs. A rerun of
the same command goes on where the last one stopped: committed steps and the step journal are kept.
"""
from __future__ import annotations

import sys
from pathlib import Path

import click

from rstar_hpc.cli.exit_codes import EXIT_FAILED
from rstar_hpc.config.loader import DEFAULT_CONFIG


@click.command("eval")
@click.option("--policy", required=True, help="A run directory (its newest published policy), a trainer checkpoint "
              "directory RUN/ckpt/<stage>[/step-N] (any committed one: the policy published at its step, else the "
              "checkpoint exported to OUT/model) or a Hugging Face model directory.")
@click.option("--data", "data", multiple=True, required=True, help="Benchmark: FILE (named after its stem) or "
              "NAME=FILE, JSONL or Parquet with question + answer. Repeatable.")
@click.option("--keep-system", is_flag=True, help="Keep a prompt's own system turn (a verl `prompt` list's) in "
              "place of the run's system text (stages[].keep_system); default: dropped.")
@click.option("--k", type=click.IntRange(min=1), default=None, help="Samples per problem [eval.k: 16].")
@click.option("--temperature", type=click.FloatRange(min=0), default=None, help="[eval.temperature: 0.6]")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=None, help="[eval.top_p: 1]")
@click.option("--max-turns", type=click.IntRange(min=1), default=None, help="[eval.max_turns: 30]")
@click.option("--max-tokens", type=click.IntRange(min=16), default=None,
              help="Response tokens, tool outputs included [eval.max_response_length: 30000, or what the model's "
                   "positions hold past the prompt budget]; more than they hold is refused.")
@click.option("--launcher", type=click.Choice(["local", "sbatch", "submitit"]), default="local", show_default=True)
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="The run directory to write [<run root>/eval-<policy>-<benchmarks>].")
@click.option("--config", default=DEFAULT_CONFIG, show_default=True,
              help="Config for the machinery (engines, sandbox, launch); its stages and model are replaced.")
@click.option("--engines", type=click.IntRange(min=1), default=None,
              help="local: engine ranks [launch.rollout's: num_nodes x tasks_per_node].")
@click.option("--prompts-per-step", type=click.IntRange(min=1), default=64, show_default=True,
              help="Problems per rollout step (the unit that is committed; the step journal keeps the rest).")
@click.argument("overrides", nargs=-1)
def command(policy, data, keep_system, k, temperature, top_p, max_turns, max_tokens, launcher, out, config, engines,
            prompts_per_step, overrides) -> None:
    """Evaluate POLICY on benchmark files; print the results table and the path of results.json.

    OVERRIDES are dotted key=value settings of CONFIG (e.g. rollout.engine.tensor_parallel_size=4).
    """
    from rstar_hpc import pipeline
    from rstar_hpc.config import load_config, prepare_run_dir
    from rstar_hpc.eval import compose as c
    from rstar_hpc.exchange.rundir import RunPaths

    pol = c.resolve_policy(policy)
    seed = load_config(config, list(overrides)).run.seed
    benchmarks = c.parse_benchmarks(data, seed)   # before anything starts: a bad file fails here
    out_dir = Path(out).expanduser().absolute() if out else c.default_out(pol, benchmarks)
    pol = c.export_policy(pol, out_dir)   # a checkpoint without a kept policy: OUT/model
    protocol = {"k": k, "temperature": temperature, "top_p": top_p, "max_turns": max_turns,
                "max_response_length": max_tokens}
    cfg = c.compose(config, list(overrides), pol, benchmarks, out_dir, protocol=protocol,
                    prompts_per_step=prompts_per_step, keep_system=keep_system)
    c.check_resumable(cfg, RunPaths(cfg.run.dir))
    paths = prepare_run_dir(cfg)
    click.echo(f"rstar-hpc eval: {pol.what}; benchmarks {', '.join(benchmarks)}; avg@{cfg.eval.k}, T "
               f"{cfg.eval.temperature}, top-p {cfg.eval.top_p}, {cfg.eval.max_turns} turns, "
               f"{cfg.eval.max_response_length} tokens; run directory {paths.dir}", err=True)
    if pipeline.stage_done(paths, c.STAGE):
        rc = 0   # finished by an earlier run of this command: nothing to sample
    elif launcher == "local":
        rc = _local(cfg, paths, engines)
    else:
        from rstar_hpc.launch.launcher import LaunchError, launch_run   # imported only when used
        try:
            outcome = launch_run(cfg, launcher, wait=True, echo=lambda line: click.echo(line, err=True))
        except LaunchError as e:
            raise click.ClickException(str(e)) from None
        status = outcome.get("status") or {}
        rc = 0 if status.get("done", True) else 1
        for problem in status.get("problems", []):
            click.echo(f"rstar-hpc eval: {problem}", err=True)
    _report(paths, rc)


def _local(cfg, paths, engines) -> int:
    from rstar_hpc.eval import compose as c
    from rstar_hpc.eval.local import LocalRunFailed, run_local
    from rstar_hpc.launch.placement import num_engines
    n = engines or num_engines(cfg)
    try:
        return run_local(paths, paths.config, c.STAGE, engines=n)
    except LocalRunFailed as e:
        raise click.ClickException(str(e)) from None


def _report(paths, rc: int) -> None:
    from rstar_hpc.eval.results import markdown, read_results
    from rstar_hpc.rollout.job import EXIT_REQUEUE

    results = read_results(paths, "eval")
    if results is None:
        again = "rerun the same command to continue" if rc in (0, EXIT_REQUEUE, 130) else \
            f"see {paths.dir}/logs and rerun the same command to continue"
        click.echo(f"rstar-hpc eval: not finished (exit status {rc}); {again}", err=True)
        sys.exit(rc or EXIT_FAILED)
    click.echo(markdown(results))
    click.echo(f"results: {paths.eval_dir('eval') / 'results.json'}")
    click.echo(f"trajectories: rstar-hpc traj show {paths.dir} --stage eval")
