"""The trainer role's job: one stage (SFT or RL) of a run, one process per GPU, resumable.

    rstar-hpc train CONFIG [key=value ...] --stage NAME          # here (a world of one), with a progress bar
    sbatch sbatch/trainer.sbatch CONFIG [key=value ...] --stage NAME   # srun: one task per GPU

Where a stage starts: its own latest checkpoint (a requeued or restarted job); else the latest checkpoint of the
nearest earlier sft/rl stage (weights, plus AdamW moments unless the stage says `reset_optimizer`, the paper's
stage 3; this stage's lr and schedule start afresh); else the Hugging Face model of `model`.
What it writes: ckpt/<stage>/ (checkpoints), policy/ (a version after each RL step, or every trainer.publish_every
with the in-memory weight sync, trainer/weight_sender.py; and at the end of SFT),
metrics/trainer.jsonl (one JSON object per step; tb/<stage>/ the same as TensorBoard scalars),
stages/<stage>/state.json (RUNNING, DONE or FAILED).
Returns 0 when the stage is done, EXIT_REQUEUE after saving on USR2 (Slurm's pre-timeout signal; the CLI exits 0
then, and sbatch/trainer.sbatch requeues the job); raises on failure, after marking the stage FAILED.
"""
from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from megatron.core import parallel_state

from rstar_hpc import pipeline
from rstar_hpc.cli.exit_codes import refusing
from rstar_hpc.config import RunConfig, StageConfig
from rstar_hpc.exchange.errors import StorageError
from rstar_hpc.exchange.policy_versions import newest_published
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.state import read_stage_state, write_heartbeat, write_stage_state
from rstar_hpc.metrics_log import metrics_sink
from rstar_hpc.trainer import flops
from rstar_hpc.trainer.arch import Arch
from rstar_hpc.trainer.checkpoint import Checkpointer, SaveOnSignal, TrainState, latest_checkpoint, load_checkpoint
from rstar_hpc.trainer.heartbeat import ProgressBeat, starting
from rstar_hpc.trainer.hf_convert import load_hf_checkpoint
from rstar_hpc.trainer.parallel import (build_optimizer, build_policy, destroy_distributed, init_distributed,
                                      naming_failed_collectives)
from rstar_hpc.trainer.stage_data import StageData
from rstar_hpc.trainer.weight_sender import makes_version, publish_step, start_server
from rstar_hpc.trainer.step import build_scheduler

log = logging.getLogger("rstar_hpc.trainer")
EXIT_REQUEUE = 75  # EX_TEMPFAIL: saved on the pre-timeout signal, the stage is not done


def run(cfg: RunConfig, stage_name: str, *, on_step: Callable[[int, dict], None] | None = None,
        keep_world: bool = False) -> int:
    """Train one stage. `keep_world`: leave the process group up for the next stage (`train --follow`; a fresh
    rendezvous on the same port deadlocked two ranks on a loaded node). Model-parallel groups are always rebuilt."""
    stage = cfg.stage(stage_name)
    if stage.kind not in pipeline.TRAINER_KINDS:
        raise ValueError(f"stage {stage.name!r} is kind {stage.kind!r}; the trainer runs {pipeline.TRAINER_KINDS}")
    paths, tcfg = RunPaths(cfg.run.dir), cfg.trainer
    backend = tcfg.backend if tcfg.backend != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    starting(paths, stage.name, "torch.distributed and the model-parallel groups", _env_rank0())
    init_distributed(tp=tcfg.tensor_parallel_size, pp=tcfg.pipeline_parallel_size, backend=backend,
                     seed=cfg.run.seed, vpp=tcfg.virtual_pipeline_parallel_size, timeout_s=tcfg.collective_timeout_s,
                     ep=tcfg.expert_parallel_size)
    rank0 = torch.distributed.get_rank() == 0
    signal_save = SaveOnSignal()
    trainer = None
    try:
        # a collective that times out (trainer.collective_timeout_s) fails naming its megatron group
        with naming_failed_collectives():
            if rank0:
                with refusing("trainer"):
                    _prepare_run(cfg)
            torch.distributed.barrier()  # the run directory and the model exist before anyone reads them
            if read_stage_state(paths, stage.name).status == "DONE":
                log.info("stage %s is DONE already; nothing to train (rerun it under a new stage name)", stage.name)
                return 0
            trainer = StageTrainer(cfg, stage, backend, signal_save)
            return trainer.train(on_step)
    except BaseException as e:
        if trainer is not None:
            trainer.drop_or_finish_saves()
        if not isinstance(e, KeyboardInterrupt):
            try:
                _set_state(paths, stage, rank0, "FAILED", message=f"{type(e).__name__}: {e}"[:500])
            except StorageError as full:   # the disk that failed the step may refuse this too: keep the first error
                log.error("could not record stage %s as FAILED: %s", stage.name, full)
        raise
    finally:
        signal_save.close()
        if trainer is not None:
            trainer.close()
        destroy_distributed(keep_world=keep_world)


class StageTrainer:
    """One sft or rl stage on this rank, built whole before it trains (as torchtitan's Trainer): the policy with
    its optimizer and lr schedule (`state`), the stage's data (`data`, a stage_data.StageData of either kind, also
    its loss and step), the saves (`ckpt`), rank 0's metrics sink and in-memory weight offers (`server`). Restored
    from the stage's own checkpoint, else the previous trainer stage's, else the model. Then `train()`, `close()`."""

    def __init__(self, cfg: RunConfig, stage_cfg: StageConfig, backend: str, signal_save: SaveOnSignal):
        self.cfg, self.stage, self.tcfg, self.backend = cfg, stage_cfg, cfg.trainer, backend
        self.paths = RunPaths(cfg.run.dir)
        self.rank0 = torch.distributed.get_rank() == 0
        self.signal_save = signal_save
        self.metrics_out = metrics_sink(self.paths, "trainer") if self.rank0 else None   # metrics/, tb/<stage>/
        self.model_dir: Path = _model_dir(cfg)
        starting(self.paths, stage_cfg.name, "building the model and its optimizer", self.rank0)
        self.state: TrainState = _build_state(cfg, stage_cfg, self.model_dir, backend)
        starting(self.paths, stage_cfg.name, "reading the stage's data", self.rank0)
        self.data: StageData = _stage_data(cfg, stage_cfg, self.paths, self.model_dir)
        starting(self.paths, stage_cfg.name, "restoring its weights and optimizer state", self.rank0)
        log.info("stage %s (%s): %s", stage_cfg.name, stage_cfg.kind, _restore(self.state, self.data, cfg, stage_cfg, self.paths))
        starting(self.paths, stage_cfg.name, "its first step", self.rank0)
        self.set_state("RUNNING", step=self.state.step, message="")
        self.ckpt = Checkpointer(self.paths.ckpt_root(stage_cfg.name), async_save=self.tcfg.checkpoint.async_save,
                                 keep_last=self.tcfg.checkpoint.keep_last, on_commit=self._committed)
        self.server = start_server(self.tcfg, self.paths) if stage_cfg.kind == "rl" else None   # weight_sync: memory
        # rank 0 beats while a step makes progress: a long step is not taken for a hang (trainer/heartbeat.py)
        self.beat = ProgressBeat(self.paths, lambda: f"stage {stage_cfg.name}: training step {self.state.step + 1}",
                                 stage_cfg.name, every_s=self.tcfg.heartbeat_s) if self.rank0 else None

    def train(self, on_step: Callable[[int, dict], None] | None = None) -> int:
        """The stage's remaining steps: 0 when it is done, EXIT_REQUEUE after a save on USR2/TERM."""
        state, stage, tcfg, data = self.state, self.stage, self.tcfg, self.data
        while state.step < stage.num_steps:
            timer = _Timer()
            with timer("read"):
                batch = data.next(stop_requested=lambda: self.signal_save.requested)
            if batch is None:  # USR2 while waiting for trajectories: the state is at a step boundary
                return self.save_and_requeue()
            with timer("train"):
                metrics = data.train(state.model, state.optimizer, state.scheduler, batch)
            state.step += 1
            stop = self.signal_save.should_save()
            if makes_version(tcfg, stage, state.step):   # in memory and/or as files (trainer/weight_sender.py)
                with timer("publish"):
                    metrics["policy_version"] = publish_step(state.model, self.paths, self.server, tcfg, stage,
                                                             state.step, source_dir=self.model_dir)
                data.now_holds(metrics["policy_version"])   # RL: it decides which tokens need a correction
            state.data_state = data.state_dict()
            self.finalize_saves(timer, metrics)  # an async save whose write has finished: commit, ack
            if stop or state.step == stage.num_steps or state.step % tcfg.checkpoint.save_every_steps == 0:
                with timer("checkpoint"):  # what the loop blocks; async: planning, the host copy, the fork
                    self.checkpoint(wait=stop or state.step == stage.num_steps)
                _pop_async_seconds(self.ckpt, metrics)
            metrics.update(timer.metrics())
            _log_step(self.metrics_out, stage, state.step, metrics, self.backend, data)
            if self.rank0:
                write_heartbeat(self.paths, "trainer", f"stage {stage.name}: trained step {state.step}/"
                                f"{stage.num_steps}", stage=stage.name, step=state.step)
            if on_step is not None:
                on_step(state.step, metrics)
            if stop and state.step < stage.num_steps:
                return self.save_and_requeue()
        self.ckpt.close()   # nothing pending: the last step's save waited
        self.set_state("DONE", step=state.step)
        torch.distributed.barrier()   # every rank sees DONE before it picks the next stage (train --follow)
        return 0

    def close(self) -> None:
        if self.beat is not None:
            self.beat.close()
        if self.server is not None:
            self.server.close()

    # -- saves
    def checkpoint(self, wait: bool = True) -> None:
        """Save (unless this step is saved or being saved already); `_committed` acks what it holds once it commits
        (sync saves: before this returns; async ones: at a later `finalize`, or here if `wait`)."""
        latest = self.paths.checkpoints(self.stage.name).latest()
        if self.state.step > max(latest[0] if latest else 0, self.ckpt.pending_step or 0):
            self.ckpt.save(self.state, stage=self.stage.name)
        if wait:
            self.ckpt.finalize(blocking=True)

    def _committed(self, saved: Path, data_state: dict) -> None:
        """A checkpoint committed: ack the trajectory steps it holds (its own data cursor), then record its step."""
        self.data.commit(saved.name, data_state)
        self.set_state("RUNNING", step=int(saved.name.split("-")[-1]))

    def finalize_saves(self, timer: _Timer, metrics: dict) -> None:
        """Non-blocking: commit an async save that every rank has finished writing (its commit's time counts as
        checkpoint time); a collective poll while one is in flight."""
        if self.ckpt.pending_step is None:
            return
        t0 = time.perf_counter()
        if self.ckpt.finalize():
            timer.add("checkpoint", time.perf_counter() - t0)
            _pop_async_seconds(self.ckpt, metrics)

    def drop_or_finish_saves(self) -> None:
        """A failure with an async save in flight: a world of one commits it (no peer can be missing from the
        commit's collectives); with peers, a failure may be this rank's alone, so the save is dropped, never half
        committed: `latest` stays on the previous checkpoint, whose data cursor the ack never went beyond."""
        ckpt = self.ckpt
        if ckpt.pending_step is None:
            return
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1:
            try:
                ckpt.close()
                return
            except BaseException as e:  # noqa: BLE001  (the first failure is the one raised)
                log.error("could not commit the pending checkpoint of step %s: %s", ckpt.pending_step, e)
        ckpt.close(abort=True)

    def save_and_requeue(self) -> int:
        self.checkpoint(wait=True)
        log.info("USR2: saved at step %d; exiting for requeue", self.state.step)
        self.set_state("RUNNING", message=f"saved at step {self.state.step} on USR2; requeued")
        return EXIT_REQUEUE

    def set_state(self, status: str, **changes) -> None:
        _set_state(self.paths, self.stage, self.rank0, status, **changes)


# --------------------------------------------------------------------------------------------------
# setup pieces


def _prepare_run(cfg: RunConfig) -> None:
    """Rank 0: the run directory, its resolved config, the (tiny) model built if the config asks for one."""
    from rstar_hpc.config import prepare_run_dir
    from rstar_hpc.models.resolve import resolve_model

    prepare_run_dir(cfg)
    resolve_model(cfg)


def _model_dir(cfg: RunConfig) -> Path:
    from rstar_hpc.models.resolve import resolve_model

    return resolve_model(cfg, build=False)


def _build_state(cfg: RunConfig, stage_cfg: StageConfig, model_dir: Path, backend: str) -> TrainState:
    """The policy with the model's weights, its optimizer and the stage's lr schedule."""
    tcfg = cfg.trainer
    model = build_policy(Arch.from_hf_config(model_dir), tcfg, backend, seed=cfg.run.seed)
    load_hf_checkpoint(model, model_dir)
    opt_cfg, lr = tcfg.optimizer, stage_cfg.lr or tcfg.optimizer.lr
    optimizer = build_optimizer(model, tcfg, lr)  # after the weights: it copies them to fp32 main weights
    schedule = opt_cfg.sft_schedule if stage_cfg.kind == "sft" else opt_cfg.schedule
    scheduler = build_scheduler(optimizer, pipeline.warmup_steps(cfg, stage_cfg.name), stage_cfg.num_steps, schedule,
                                opt_cfg.min_lr_ratio)
    return TrainState(model, optimizer, scheduler)


def _stage_data(cfg: RunConfig, stage_cfg: StageConfig, paths: RunPaths, model_dir: Path) -> StageData:
    """The one place the stage's kind picks its data; past it the loop speaks StageData only."""
    if stage_cfg.kind == "sft":
        from rstar_hpc.trainer.sft import SFTStageData

        with refusing("trainer"):   # the stage's data file; an rl stage's is the run's own trajectories
            return SFTStageData(cfg, stage_cfg, model_dir)
    from rstar_hpc.trainer.rl import RLStageData

    return RLStageData(cfg, stage_cfg, paths)


def _restore(state: TrainState, data: StageData, cfg: RunConfig, stage_cfg: StageConfig, paths: RunPaths) -> str:
    """Resume the stage, or carry the previous trainer stage's policy over, or start from the model."""
    own = latest_checkpoint(paths.ckpt_root(stage_cfg.name))
    if own is not None:
        load_checkpoint(state, own)
        data.load_state_dict(state.data_state)
        return f"resumed from {own} (step {state.step})"
    data.load_state_dict(data.initial_state)  # a fresh stage: checks that the data's own cursor agrees
    prev = pipeline.previous_trainer_stage(cfg, stage_cfg.name)
    if prev is None:
        return "starting from the model's weights"
    path = latest_checkpoint(paths.ckpt_root(prev.name))
    if path is None:
        raise FileNotFoundError(f"stage {stage_cfg.name!r} follows trainer stage {prev.name!r}, which has no checkpoint in "
                                f"{paths.ckpt_root(prev.name)}; train it first (rstar-hpc train CONFIG --stage "
                                f"{prev.name}) or remove it from `stages`")
    # the earlier stage's optimizer state carries its lr and schedule; this stage's hyper-parameters apply
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in state.optimizer.param_groups]
    scheduler, state.scheduler = state.scheduler, None
    load_checkpoint(state, path, reset_optimizer=stage_cfg.reset_optimizer)
    for g, h in zip(state.optimizer.param_groups, hyper):
        g.update(h)
    state.scheduler, state.step, state.data_state = scheduler, 0, {}
    return (f"weights {'' if stage_cfg.reset_optimizer else 'and AdamW moments '}from {path} "
            f"(stage {prev.name}){'; optimizer reset' if stage_cfg.reset_optimizer else ''}")


def _pop_async_seconds(ckpt: Checkpointer, metrics: dict) -> None:
    """`time/checkpoint_async(s)`: the async saves committed in this step, from their save() to their commit."""
    if ckpt.async_save and ckpt.async_seconds:
        metrics["time/checkpoint_async(s)"] = metrics.get("time/checkpoint_async(s)", 0.0) + sum(ckpt.async_seconds)
        ckpt.async_seconds.clear()


def _env_rank0() -> bool:
    """Rank 0 before torch.distributed says so: the launchers' rank variables."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0


def _set_state(paths: RunPaths, stage_cfg: StageConfig, rank0: bool, status: str, **changes) -> None:
    if not rank0:
        return
    current = read_stage_state(paths, stage_cfg.name)
    write_stage_state(paths, current.advance(status, policy_version=newest_published(paths), **changes))


# --------------------------------------------------------------------------------------------------
# logging


class _Timer:
    def __init__(self):
        self.start, self.phases = time.perf_counter(), {}

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        yield
        self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - t0

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    def metrics(self) -> dict[str, float]:
        return {**{f"time/{k}(s)": v for k, v in self.phases.items()}, "time/step(s)": time.perf_counter() - self.start}


def _mfu(metrics: dict) -> float | None:
    """Model FLOPs utilisation of this GPU (trainer/flops.py, as gpu-check's): the step's model FLOPs on this
    data-parallel rank's samples over the time of its update and pi_old recompute, shared by the tensor- and
    pipeline-parallel ranks; the peak is RSTAR_HPC_PEAK_TFLOPS, else the card's (none for an unknown card)."""
    if "perf/model_flops" not in metrics:  # a skipped (empty) RL step
        return None
    env = os.environ.get("RSTAR_HPC_PEAK_TFLOPS")
    peak = float(env) if env else flops.peak_tflops(torch.cuda.get_device_name())
    if peak is None:
        return None
    seconds = metrics["step_time_s"] + metrics.get("time/recompute_old_logprobs(s)", 0.0)
    shared = parallel_state.get_tensor_model_parallel_world_size() * \
        parallel_state.get_pipeline_model_parallel_world_size()
    return flops.mfu(metrics["perf/model_flops"], seconds, peak, devices=shared)


def _log_step(out, stage_cfg: StageConfig, step: int, metrics: dict, backend: str, data: StageData) -> None:
    if out is None:
        return
    mfu = _mfu(metrics) if backend == "cuda" else None
    if mfu is not None:
        metrics["perf/mfu"] = mfu
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
    out.write({"stage": stage_cfg.name, "step": step, "time": time.time(), **clean})
    extra = data.describe(metrics)
    log.info("%s step %*d/%d | loss %8.4f | grad_norm %7.3f | lr %.2e | tok/s %8.0f%s | step %.2fs", stage_cfg.name,
             len(str(stage_cfg.num_steps)), step, stage_cfg.num_steps, metrics.get("loss", float("nan")),
             metrics.get("grad_norm", float("nan")), metrics.get("lr", float("nan")), metrics.get("tokens_per_s", 0.0),
             extra, metrics["time/step(s)"])
