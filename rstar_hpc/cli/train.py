"""`rstar-hpc train`: one trainer stage (SFT or RL), here or as a Slurm job, with a progress bar."""
from __future__ import annotations

import json
import os
import sys
import time

import click

from rstar_hpc.config.loader import DEFAULT_CONFIG
from rstar_hpc.config.stages import StageConfig


@click.command("train")
@click.argument("config", default=DEFAULT_CONFIG)
@click.argument("overrides", nargs=-1)
@click.option("--stage", "stage_name", default=None,
              help="Stage to train [the first sft/rl stage of the config that is not DONE].")
@click.option("--follow", is_flag=True,
              help="Train every sft/rl stage of the config in order, skipping DONE ones (the stage driver's walk: what "
                   "`rstar-hpc launch` runs); each resumes where the run directory says it stopped.")
@click.option("--submit", is_flag=True,
              help="Submit sbatch/trainer.sbatch (resources from launch.trainer) and follow the job, instead of "
                   "training in this process.")
@click.option("--plan", "show_plan", is_flag=True,
              help="Train nothing: print each stage's per-rank memory (weights, grads, optimizer state, activations) "
                   "and micro-batch plan, from the config alone (no GPU; exit 1 over --gpu-memory-gib).")
@click.option("--json", "as_json", is_flag=True, help="With --plan: one JSON object.")
@click.option("--gpu-memory-gib", type=float, default=80.0, show_default=True,
              help="With --plan: the GPU memory to check the estimate against.")
def command(config: str, overrides: tuple[str, ...], stage_name: str | None, follow: bool, submit: bool,
            show_plan: bool, as_json: bool, gpu_memory_gib: float) -> None:
    """Train one stage of CONFIG: resume its latest checkpoint (or carry the previous stage's policy over),
    train to the stage's num_steps, publish policies for the rollout engines; on USR2 save and exit 0 before
    the end (sbatch/trainer.sbatch then requeues). Under srun every task is one rank (one GPU); alone it is a
    world of one.

    CONFIG is a config name (`rstar-hpc config show --list`) or a YAML path; OVERRIDES are dotted key=value pairs.
    """
    if show_plan:
        print_memory_plan(config, overrides, as_json, gpu_memory_gib)
        return
    from rstar_hpc.cli.exit_codes import refusing
    from rstar_hpc.config import load_config

    with refusing("trainer"):
        cfg = load_config(config, overrides)
    if follow and (stage_name or submit):
        raise click.UsageError("--follow walks every stage: it takes neither --stage nor --submit")
    stage = _pick_stage(cfg, stage_name, none_left_ok=follow)
    if submit:
        _submit_and_follow(cfg, config, overrides, stage)
        return
    if stage is not None and cfg.model.path is not None:
        from rstar_hpc.models.resolve import resolve_model
        with refusing("trainer"):   # on every rank, before the minute torch and megatron-core take to import
            resolve_model(cfg, build=False)
    _train_here(cfg, stage, follow)


def _train_here(cfg, stage_cfg: StageConfig, follow: bool) -> None:
    """This process is a trainer rank (alone: a world of one): train `stage`, then with `follow` each one after."""
    import warnings

    from tqdm import tqdm

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")  # megatron-core's import-time notes

    from rstar_hpc.launch.binding import bind
    from rstar_hpc.logs import init_logging

    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    init_logging("trainer", rank, rank0_only=True)
    bind(cfg, "trainer")   # before torch sees CUDA

    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.trainer.heartbeat import starting

    # the launcher's hang watch counts from here: say what the first silent seconds are
    starting(RunPaths(cfg.run.dir), stage_cfg.name, "importing torch and megatron-core", rank == 0)
    from rstar_hpc.trainer.job import EXIT_REQUEUE, run

    code = 0
    while stage_cfg is not None:
        # the bar only on an interactive terminal of rank 0; batch logs get the fixed-field step lines
        bar = tqdm(total=stage_cfg.num_steps, desc=f"train {stage_cfg.name}", unit="step",
                   disable=None if rank == 0 else True)

        def on_step(step: int, metrics: dict, bar=bar) -> None:
            bar.n = step
            bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.4f}", refresh=False)
            bar.refresh()

        try:
            code = run(cfg, stage_cfg.name, on_step=on_step, keep_world=True)
        finally:
            bar.close()
        ran = stage_cfg.name   # for the requeue note below: `stage` is None after the loop
        stage_cfg = _pick_stage(cfg, None, none_left_ok=True) if follow and code == 0 else None
    from rstar_hpc.trainer.parallel import destroy_distributed
    destroy_distributed()
    if code == EXIT_REQUEUE:
        # exit 0 on every rank: under `srun --kill-on-bad-exit` one rank's non-zero exit kills the others; the
        # sbatch script knows it sent USR2 and requeues
        if rank == 0:
            click.echo(f"stage {ran}: saved on USR2 before the end; run the same command again to continue",
                       err=True)
        code = 0
    sys.exit(code)


def print_memory_plan(config: str, overrides: tuple[str, ...], as_json: bool, gpu_memory_gib: float) -> None:
    """Per-rank memory and the micro-batch plan of each stage (rstar_hpc/trainer/memory_plan.py has the formulas);
    exit 1 if the estimate exceeds `gpu_memory_gib`."""
    from rstar_hpc.config import load_config
    from rstar_hpc.trainer.memory_plan import format_plan, make_plan

    try:
        result = make_plan(load_config(config, overrides), gpu_memory_gib)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(result.to_dict()) if as_json else format_plan(result))
    if result.total_gib > gpu_memory_gib:
        sys.exit(1)


def _pick_stage(cfg, name: str | None, none_left_ok: bool = False):
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc import pipeline

    if name is not None:
        try:
            return cfg.stage(name)
        except KeyError as e:
            raise click.BadParameter(str(e.args[0]), param_hint="--stage") from None
    for s in cfg.stages:
        if s.kind in pipeline.TRAINER_KINDS and not pipeline.stage_done(RunPaths(cfg.run.dir), s.name):
            return s
    if none_left_ok:
        return None
    raise click.UsageError("no sft/rl stage left to train in this config (all DONE, or none); pass --stage")


STEP_OPTS_ENV = "RSTAR_TRAINER_STEP_OPTS"   # sbatch/trainer.sbatch's srun takes its GPU and memory options from it


def submit_options(cfg, stage_name: str, env=None) -> tuple[list[str], dict[str, str]]:
    """The sbatch options and the environment of `train --submit`'s job (sbatch/trainer.sbatch), as the run's
    launcher sizes its trainer: the trainer component's resources (hetjob.role_options: GPUs per node, never per
    task; the node's memory for a GPU role unless launch.trainer.mem says otherwise), and the srun step asking for
    the GPUs and memory the launcher's trainer step does (placement.step_resources), in STEP_OPTS_ENV."""
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.launch import hetjob, placement

    logs = RunPaths(cfg.run.dir).logs
    sbatch_args = [*hetjob.role_options(cfg, "trainer"), f"--signal=B:USR2@{cfg.launch.signal_lead_s}",
                   *hetjob.site_options(cfg), f"--output={logs}/trainer-{stage_name}-%j.out"]
    env = {**(os.environ if env is None else env), STEP_OPTS_ENV: " ".join(placement.step_resources(cfg, "trainer"))}
    return sbatch_args, env


def _submit_and_follow(cfg, config: str, overrides: tuple[str, ...], stage_cfg: StageConfig) -> None:
    from tqdm import tqdm

    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.launch import submit, wait_for_job

    res, paths = cfg.launch.trainer, RunPaths(cfg.run.dir)
    paths.create()
    sbatch_args, env = submit_options(cfg, stage_cfg.name)
    job = submit("trainer", [config, *overrides, "--stage", stage_cfg.name], sbatch_args=sbatch_args, env=env)
    click.echo(f"submitted job {job}: stage {stage_cfg.name}; log {paths.logs}/trainer-{stage_cfg.name}-{job}.out")
    metrics = paths.metrics("trainer")
    bar = tqdm(total=stage_cfg.num_steps, desc=f"job {job} {stage_cfg.name}", unit="step")

    def poll(fields: dict) -> None:
        bar.set_postfix(state=fields.get("JobState", "?"), refresh=False)
        for line in metrics.read_text().splitlines()[-20:] if metrics.exists() else []:
            row = json.loads(line)
            if row.get("stage") == stage_cfg.name:
                bar.n = max(bar.n, row["step"])
        bar.refresh()
        time.sleep(1.5)

    try:
        wait_for_job(job, timeout_s=res.time_min * 60 * (cfg.launch.max_restarts + 1) + 600, on_poll=poll)
    finally:
        bar.close()
    click.echo(f"job {job} completed; stage {stage_cfg.name} at step {bar.n}/{stage_cfg.num_steps}")
