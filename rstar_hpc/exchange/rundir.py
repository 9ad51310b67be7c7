"""RunPaths: every location of a run on shared storage. Nothing else joins path strings.

    <run_dir>/
      config.yaml                                  resolved config (defaults + overrides), written at launch
      stages/<stage>/state.json                    StageState: status, step, data cursor, policy version
      stages/<stage>/cursors/<consumer>.json       a consumer's exactly-once cursor over trajectory steps
      ckpt/<stage>/step-00000123/                  a checkpoint; complete iff it holds COMMITTED.json
      ckpt/<stage>/.step-00000123.tmp-<host>-<pid>-<thread>/  one being written (never read; pruned on retention)
      ckpt/<stage>/latest                          "step-00000123": moved only after a complete commit
      policy/v-00000007/                           weights published for rollout engines (same protocol)
      policy/latest                                "v-00000007"
      traj/<stage>/step-00000123/
          <producer>-<seq>-<attempt>.arrows        Arrow IPC stream shard (uncompressed, memory-mapped)
          <producer>.commit.json                   commit record, written last: shards, rows, bytes, sha256
      rendezvous/<role>/<name>.json                host/port announcements (rendezvous.py)
      export/<stage>/step-00000123.{parquet,jsonl} copies made by `rstar-hpc traj export`
      data/<stage>.parquet, data/<stage>.stats.json   the prompt subset a hard_subset stage built, and its counts
      eval/<stage>/results.json, results.md      an eval stage's figures (rstar_hpc.eval)
      model/                                     `rstar-hpc eval`'s OUT only: the checkpoint it exported to evaluate
      launch/jobs.json                           the jobs `rstar-hpc launch` submitted (run status, cancel)
      launch/refused-<role>.json                 the error a role refused its config or inputs with (no restart)
      heartbeat/<role>.json                      what each role is doing now, rewritten every few seconds
      generate/<job id>/{samples.jsonl,summary.json}  output of `rstar-hpc generate` (the demo's job)
      logs/                                        Slurm and role logs
      metrics/<role>.jsonl                         one JSON object per step and role
      tb/<stage>/events.out.tfevents.*             TensorBoard scalars of the same records (rstar_hpc.metrics_log)
      report/report.{md,html}, report/*.png        `rstar-hpc report RUN` (rstar_hpc.report)

Every file other roles read is published atomically (tmp in the same directory, fsync, rename; atomic.py).
On Lustre, `create()` stripes `ckpt/` progressively (1 OST for the first 64 MiB, 4 beyond, 4 MiB stripes:
large per-rank checkpoint files) and `traj/` and `policy/` with count 1 (many mid-sized files, one writer
each); layouts are inherited, so this must happen before files exist. Elsewhere it is a no-op.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rstar_hpc.exchange import rendezvous
from rstar_hpc.exchange.atomic import is_tmp

COMMIT_SUFFIX = ".commit.json"   # <producer><COMMIT_SUFFIX>: a producer's commit record of a trajectory step
RUN_ROOT_ENV = "RSTAR_HPC_RUN_ROOT"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
STRIPING = {
    "ckpt": ["-E", "64M", "-c", "1", "-E", "-1", "-c", "4", "-S", "4M"],
    "traj": ["-c", "1"],
    "policy": ["-E", "64M", "-c", "1", "-E", "-1", "-c", "4", "-S", "4M"],
}


@dataclass(frozen=True)
class RunPaths:
    dir: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "dir", Path(self.dir).absolute())

    @classmethod
    def resolve(cls, run: str | os.PathLike) -> "RunPaths":
        """A run directory path, or a run name under $RSTAR_HPC_RUN_ROOT (else ./runs), like config `run.root`."""
        tried = [Path(run)]
        if os.sep not in os.fspath(run):
            tried.append(default_run_root() / run)
        for path in tried:
            if path.is_dir():
                return cls(path)
        raise FileNotFoundError(f"no run directory {run!r}; tried {', '.join(str(p.absolute()) for p in tried)}. "
                                f"Pass the run directory path, or set ${RUN_ROOT_ENV} to the runs root.")

    @property
    def name(self) -> str:
        return self.dir.name

    # -- config, stages ---------------------------------------------------------------------------------------
    @property
    def config(self) -> Path:
        return self.dir / "config.yaml"

    def stage_dir(self, stage: str) -> Path:
        return self.dir / "stages" / _check("stage", stage)

    def stage_state(self, stage: str) -> Path:
        return self.stage_dir(stage) / "state.json"

    def stages(self) -> list[str]:
        return _listdir(self.dir / "stages")

    def rollout_carry(self, stage: str, step: int) -> Path:
        """Partial rollouts: the trajectories step `step` paused and carries into the next (rollout/carry.py); out of
        the trajectory directories, so trajectory retention never removes one before it is resumed."""
        return self.stage_dir(stage) / "carry" / f"step-{_step(step):08d}.json"

    def cursor(self, stage: str, consumer: str) -> Path:
        return self.stage_dir(stage) / "cursors" / f"{_check('consumer', consumer)}.json"

    # -- checkpoints and published policies ---------------------------------------------------------------------
    def ckpt_root(self, stage: str) -> Path:
        return self.dir / "ckpt" / _check("stage", stage)

    @property
    def policy_root(self) -> Path:
        return self.dir / "policy"

    def checkpoints(self, stage: str):
        from rstar_hpc.exchange.checkpoints import CommittedDirs

        return CommittedDirs(self.ckpt_root(stage), prefix="step")

    def policies(self):
        from rstar_hpc.exchange.checkpoints import CommittedDirs

        return CommittedDirs(self.policy_root, prefix="v")

    # -- trajectories -----------------------------------------------------------------------------------------
    def traj_stage_dir(self, stage: str) -> Path:
        return self.dir / "traj" / _check("stage", stage)

    def traj_step_dir(self, stage: str, step: int) -> Path:
        return self.traj_stage_dir(stage) / f"step-{_step(step):08d}"

    def traj_commit(self, stage: str, step: int, producer: str) -> Path:
        return self.traj_step_dir(stage, step) / f"{_check('producer', producer)}{COMMIT_SUFFIX}"

    def traj_commits(self, stage: str, step: int) -> dict[str, Path]:
        """The commit records present in a step directory, by producer (tmp files of a commit in flight skipped)."""
        folder = self.traj_step_dir(stage, step)
        return {name[: -len(COMMIT_SUFFIX)]: folder / name
                for name in _listdir(folder) if name.endswith(COMMIT_SUFFIX) and not is_tmp(name)}

    def traj_stages(self) -> list[str]:
        return _listdir(self.dir / "traj")

    def traj_steps(self, stage: str) -> list[int]:
        """Steps with a trajectory directory (committed or not), ascending."""
        return sorted(int(n[5:]) for n in _listdir(self.traj_stage_dir(stage)) if re.fullmatch(r"step-\d+", n))

    def export_file(self, stage: str, step: int, fmt: str) -> Path:
        """Where `rstar-hpc traj export` copies a step (fmt: parquet or jsonl)."""
        return self.dir / "export" / _check("stage", stage) / f"step-{_step(step):08d}.{fmt}"

    # -- stage outputs, launch records ---------------------------------------------------------------------------
    def stage_data(self, stage: str) -> Path:
        """The prompt subset a hard_subset stage wrote (Parquet); `stage_data_stats` its counts."""
        return self.dir / "data" / f"{_check('stage', stage)}.parquet"

    def stage_data_stats(self, stage: str) -> Path:
        return self.dir / "data" / f"{_check('stage', stage)}.stats.json"

    def eval_dir(self, stage: str) -> Path:
        return self.dir / "eval" / _check("stage", stage)

    def val_results(self, stage: str, step: int) -> Path:
        """The scores of rl stage `stage`'s validation pass at step `step` (rstar_hpc/rollout/validation.py)."""
        return self.eval_dir(stage) / "val" / f"step-{_step(step):08d}.json"

    @property
    def exported_model(self) -> Path:
        """The Hugging Face directory `rstar-hpc eval --policy RUN/ckpt/<stage>/step-N` exports a checkpoint into
        when no policy of its step is kept (this run directory being the evaluation's OUT)."""
        return self.dir / "model"

    @property
    def launch_record(self) -> Path:
        return self.dir / "launch" / "jobs.json"

    @property
    def allocation(self) -> Path:
        """The job's latest start: its Slurm job, restart count, time and each role's nodes (launch/nodes.py)."""
        return self.dir / "launch" / "allocation.json"

    @property
    def launch_events(self) -> Path:
        """What the launchers did about faults (a role restarted, hung, a sandbox service gone): one JSON line each,
        appended (exchange/events.py); `run status` names them."""
        return self.dir / "launch" / "events.jsonl"

    def refusal(self, role: str) -> Path:
        """The error a role refused its config or inputs with (cli/exit_codes.Refused): its launcher stops the job."""
        return self.dir / "launch" / f"refused-{_check('role', role)}.json"

    def heartbeat(self, role: str) -> Path:
        return self.dir / "heartbeat" / f"{_check('role', role)}.json"

    def observed_placement(self, role: str, rank: int) -> Path:
        """What task `rank` of `role` got when it last started (host, GPUs, CPUs): exchange/placement.py."""
        return self.dir / "placement" / f"{_check('role', role)}-{int(rank)}.json"

    # -- rendezvous, logs, metrics ------------------------------------------------------------------------------
    def rendezvous_dir(self, role: str) -> Path:
        return Path(rendezvous.rendezvous_dir(self.dir, role))

    def announcement(self, role: str, name: str) -> Path:
        return Path(rendezvous.announcement_path(self.dir, role, name))

    def generate_dir(self, tag: str) -> Path:
        """Output of one `rstar-hpc generate` job (tag: the Slurm job id, or 'local')."""
        return self.dir / "generate" / _check("generate tag", tag)

    @property
    def logs(self) -> Path:
        return self.dir / "logs"

    def metrics(self, role: str) -> Path:
        return self.dir / "metrics" / f"{_check('role', role)}.jsonl"

    @property
    def tb_root(self) -> Path:
        """`tensorboard --logdir` this: one subdirectory (a TensorBoard run) per stage."""
        return self.dir / "tb"

    def tb_dir(self, stage: str) -> Path:
        return self.tb_root / _check("stage", stage)

    def eval_stages(self) -> list[str]:
        """Stages with an eval/<stage>/ directory (results.json written or not)."""
        return _listdir(self.dir / "eval")

    @property
    def report_dir(self) -> Path:
        """Where `rstar-hpc report` writes by default."""
        return self.dir / "report"

    # -- creation -----------------------------------------------------------------------------------------------
    def create(self, stripe: bool = True) -> list[str]:
        """Make the top-level directories; on Lustre set striping first. Returns the `lfs` commands run."""
        self.dir.mkdir(parents=True, exist_ok=True)
        applied = []
        for sub in ("ckpt", "traj", "policy", "stages", "rendezvous", "logs", "metrics"):
            folder = self.dir / sub
            fresh = not folder.exists()
            folder.mkdir(exist_ok=True)
            if stripe and fresh and sub in STRIPING:
                cmd = apply_striping(folder, STRIPING[sub])
                if cmd:
                    applied.append(cmd)
        return applied


def default_run_root() -> Path:
    """Where run directories live when a config names no `run.root`: $RSTAR_HPC_RUN_ROOT, else ./runs."""
    return Path(os.environ.get(RUN_ROOT_ENV) or "runs")


def apply_striping(folder: Path, args: list[str]) -> str | None:
    """`lfs setstripe ARGS folder` when `lfs` exists; None (no-op) elsewhere. Failure is reported, not fatal:
    a site default layout is still a working layout."""
    lfs = shutil.which("lfs")
    if lfs is None:
        return None
    cmd = [lfs, "setstripe", *args, str(folder)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        import logging

        logging.getLogger(__name__).warning("%s failed (%s); keeping the file system's default layout",
                                            " ".join(cmd), done.stderr.strip())
        return None
    return " ".join(["lfs", "setstripe", *args, str(folder)])


def _check(what: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"{what} name {value!r} must match {_NAME.pattern} (letters, digits, '_' and '-'; "
                         f"it becomes a file name in the run directory)")
    return value


def _step(step: int) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return step


def _listdir(folder: Path) -> list[str]:
    try:
        return sorted(n for n in os.listdir(folder) if not n.startswith("."))
    except FileNotFoundError:
        return []
