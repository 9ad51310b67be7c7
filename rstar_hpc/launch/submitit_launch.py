"""The Python launcher: a run through submitit, one job per role.

submitit cannot express a heterogeneous job (submitit#1741), so `rstar-hpc launch --launcher submitit` submits
three jobs at once, without dependencies: trainer (launch.trainer), rollout (launch.rollout), sandbox
(launch.sandbox). They need none, because they meet only in the run directory: the rollout waits for the sandbox's
announcement and for each policy it needs, the trainer for each step's trajectories. Each job runs a `RoleJob`:
- it starts the role's command (rstar_hpc.launch.roles) as a child process and starts it again if it dies before
  the role is done, or if its heartbeat is older than launch.hang_timeout_s (its step killed first, and cancelled
  through Slurm if its srun hangs too: the step is named rstar-<role>, as the supervisor's are), up to
  launch.role_restarts times, like the sbatch supervisor does (events in RUN/launch/events.jsonl);
- a role that refuses its config or inputs (exit 78, or its RUN/launch/refused-<role>.json: cli/exit_codes.Refused)
  is not started again, as under the supervisor: its job fails (a `refused` event), and the other roles' jobs,
  seeing its record, stop their role (it saves, as on TERM) and end without a requeue;
- on USR2 (`launch.signal_lead_s` before the time limit, or preemption), submitit calls `checkpoint`: the child
  is told to save (USR2) and waited for, then submitit requeues the job (launch.max_restarts times at most) and the
  requeued job starts the role again, which resumes from the run directory;
- the sandbox job serves until the run is done, then ends.
Each job runs one submitit task per node, holding the cores of every task its role places there; it starts the
role's tasks with the same srun line as the sbatch supervisor (rstar_hpc.launch.placement), with --overlap. The
rollout on one node (or with launch.mpi=none) runs the command itself, which starts every rank.

    job = submit_command(cfg, "sandbox", ["make-tiny-model", "/tmp/m"])   # any `rstar-hpc` command as a job
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from rstar_hpc.cli.exit_codes import EXIT_REFUSED, refusal
from rstar_hpc.config import ConfigError, RunConfig
from rstar_hpc.exchange.events import record_event
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.launch import container, placement
from rstar_hpc.launch.roles import (ROLES, hostnames, local_ranks_env, role_argv, role_done, role_env, roles_needed,
                                    run_done)
from rstar_hpc.launch.watch import end_step, kill_step, named_step, stale

log = logging.getLogger("rstar_hpc.launch")


def executor(cfg: RunConfig, role: str, *, tasks_per_node: int | None = None, folder: Path | None = None):
    """An AutoExecutor sized from `cfg.launch.<role>`, logging to <run>/logs/submitit/<job id>."""
    import submitit

    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
    folder = folder or RunPaths(cfg.run.dir).logs / "submitit" / "%j"
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=cfg.launch.max_restarts)
    ex.update_parameters(**role_parameters(cfg, role, tasks_per_node=tasks_per_node))
    return ex


def role_parameters(cfg: RunConfig, role: str | None = None, *, tasks_per_node: int | None = None) -> dict:
    """submitit's parameters of a role's job (all roles the run needs when `role` is None): what --dry-run prints."""
    if role is None:
        return {r: role_parameters(cfg, r, tasks_per_node=1) for r in roles_needed(cfg)}
    res, launch = getattr(cfg.launch, role), cfg.launch
    extra = {"requeue": True, "open-mode": "append"}
    for key in ("gres", "constraint"):
        if getattr(res, key):
            extra[key] = getattr(res, key)
    if res.exclusive:
        extra["exclusive"] = True
    # the one submitit task of a node holds the cores of every task the role starts there (placement.py)
    per_node = placement.tasks_per_node(cfg, role)
    tasks = tasks_per_node or res.tasks_per_node
    cpus = res.cpus_per_task * per_node if tasks == 1 else res.cpus_per_task
    params = dict(name=f"rstar-{cfg.run.name}-{role}", timeout_min=res.time_min, nodes=res.num_nodes,
                  tasks_per_node=tasks, cpus_per_task=cpus, slurm_partition=res.partition,
                  slurm_signal_delay_s=launch.signal_lead_s, slurm_additional_parameters=extra)
    if res.gpus_per_node and launch.gpu_gres:
        params["gpus_per_node"] = res.gpus_per_node
    mem = placement.role_mem(cfg, role)
    if mem is not None:
        params["slurm_mem"] = mem
    if launch.account:
        params["slurm_account"] = launch.account
    if launch.qos:
        params["slurm_qos"] = launch.qos
    setup = [*(f"module load {m}" for m in launch.modules), *launch.setup]
    if setup:
        params["slurm_setup"] = setup
    return params


class RoleJob:
    """One role of a run, as a checkpointable submitit callable (pickled with the run directory only)."""

    def __init__(self, run_dir: str, role: str):
        self.run_dir, self.role = str(run_dir), role
        self._child: subprocess.Popen | None = None
        self._stop = False
        self._refused: dict | None = None   # another role's refusal, which stopped this one
        self.hang_timeout_s: float | None = None   # launch.hang_timeout_s unless set (tests)

    def __getstate__(self) -> dict:
        return {"run_dir": self.run_dir, "role": self.role}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["run_dir"], state["role"])

    def _cfg(self):
        from rstar_hpc.config import load_config
        return load_config(str(Path(self.run_dir) / "config.yaml"))

    def argv(self, cfg, attempt: int) -> tuple[list[str], dict[str, str]]:
        """The child's command and environment: the role's tasks started with srun --overlap inside this job
        (placement.step_argv, as the sbatch supervisor starts them), or the role's command itself where it is one
        task; a one-node rollout (or launch.mpi=none) runs the command itself, which starts every rank. An srun
        step is named after the role (watch.named_step, as the supervisor names its steps), so that a hung one is
        cancelled through Slurm (watch.kill_step) rather than left holding its resources."""
        argv, env = self._command(cfg, attempt)
        return named_step(argv, self.role), env

    def _command(self, cfg, attempt: int) -> tuple[list[str], dict[str, str]]:
        res = getattr(cfg.launch, self.role)
        nodes = os.environ.get("SLURM_JOB_NODELIST")
        env = role_env(cfg, self.role, nodes, attempt)
        start = cfg.launch.mpi.start
        if self.role == "rollout" and ((res.num_nodes == 1 and start != "world") or start == "none"):
            argv = [*role_argv(cfg, self.role, self.run_dir), "--engines", str(placement.num_engines(cfg))]
            return container.in_image(cfg, self.role, argv), local_ranks_env(env)
        tasks = [t for t in placement.plan(cfg) if t.role == self.role]
        if len(tasks) == 1:
            return container.in_image(cfg, self.role, role_argv(cfg, self.role, self.run_dir)), env
        if self.role == "rollout":
            env["SLURM_HOSTFILE"] = str(placement.write_hostfile(cfg, self.run_dir, hostnames(nodes)))
        return placement.step_argv(cfg, self.role, self.run_dir, overlap=True), env

    def __call__(self) -> str:
        from rstar_hpc.logs import init_logging

        init_logging(f"submitit-{self.role}", 0)
        paths = RunPaths(self.run_dir)
        try:
            cfg = self._cfg()
        except ConfigError as e:   # no start could get further
            record_event(paths, "refused", role=self.role, message=str(e))
            raise
        restarts = 0
        while not self._stop:
            if self.role != "sandbox" and role_done(cfg, paths, self.role):
                return f"{self.role}: every stage of the role is done"
            if self._refused_elsewhere(paths):
                break
            argv, env = self.argv(cfg, restarts)
            log.info("starting %s: %s", self.role, " ".join(argv))
            # a session of its own: a hung child's whole process group can be killed (watch.kill_step)
            self._child = subprocess.Popen(argv, env=env, start_new_session=True)
            code, hung = self._watch(cfg, paths, argv)
            if code is None:
                return "sandbox: the run is done"
            if self._stop or (self.role != "sandbox" and role_done(cfg, paths, self.role)):
                continue
            host = os.environ.get("SLURM_JOB_NODELIST")
            if hung is None and (code == EXIT_REFUSED or refusal(paths, self.role)):
                found = refusal(paths, self.role)
                why = found["message"] if found else "see its log in RUN/logs/submitit/"
                record_event(paths, "refused", role=self.role, host=host, exit=code, message=why)
                raise RuntimeError(f"{self.role} refused to run (exit {code}): {why}\nno restart can fix this: fix the "
                                   f"config or the input named above, then `rstar-hpc launch {paths.config} "
                                   f"[key=value ...]` continues the run")
            restarts += 1
            if hung is None:
                record_event(paths, "crash", role=self.role, host=host, exit=code, restart=restarts)
            if restarts > cfg.launch.role_restarts:
                record_event(paths, "gave_up", role=self.role, host=host, exit=code, restarts=restarts - 1,
                             limit=cfg.launch.role_restarts)
                raise RuntimeError(f"{self.role} {'hung' if hung else f'ended (exit {code})'} {restarts} times, "
                                   f"more than launch.role_restarts={cfg.launch.role_restarts}; see RUN/logs/submitit/")
            log.warning("%s %s before its stages were done; starting it again (%d/%d)", self.role,
                        "hung" if hung else f"ended (exit {code})", restarts, cfg.launch.role_restarts)
        if self._refused:
            return f"{self.role}: stopped, the {self._refused['role']} refused its config or inputs"
        return f"{self.role}: stopped"

    def _refused_elsewhere(self, paths: RunPaths) -> dict | None:
        """Another role's refusal since the run's launch: this one's work cannot lead anywhere, so it stops."""
        self._refused = self._refused or next((found for r in ROLES if r != self.role
                                               if (found := refusal(paths, r))), None)
        return self._refused

    def _watch(self, cfg, paths: RunPaths, argv: list[str]) -> tuple[int | None, dict | None]:
        """The child's exit code (None when this is the sandbox and the run is done: the child is then stopped),
        and what a hung child was doing when its stale heartbeat got it killed (None if it was not)."""
        since = time.time()
        timeout = cfg.launch.hang_timeout_s if self.hang_timeout_s is None else self.hang_timeout_s
        while self._child.poll() is None:
            if self.role == "sandbox" and run_done(cfg, paths):
                end_step(self._child, argv)
                return None, None
            if not self._stop and self._refused_elsewhere(paths):
                log.error("the %s refused its config or inputs (%s): stopping the %s, whose work cannot lead anywhere "
                          "until that is fixed", self._refused["role"], self._refused["message"], self.role)
                self._stop = True
                end_step(self._child, argv)
                return self._child.returncode, None
            hung = None if self._stop else stale(paths, self.role, since, timeout)
            if hung is not None:
                log.error("%s hung: no heartbeat for %.0f s (more than launch.hang_timeout_s=%g), last doing: %s "
                          "(host %s); killing it and starting it again", self.role, hung["silent_s"], timeout,
                          hung["doing"], hung["host"] or "?")
                record_event(paths, "hang", role=self.role, **hung, timeout_s=timeout)
                kill_step(self._child, argv)
                return self._child.returncode, hung
            time.sleep(2.0)
        return self._child.returncode, None

    def checkpoint(self, *args, **kwargs):
        """USR2 (time limit near, or preemption): the child saves and exits, then submitit requeues this job."""
        import submitit

        self._stop = True
        child = self._child
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGUSR2)
            try:
                child.wait(max(10, self._cfg().launch.signal_lead_s - 15))
            except subprocess.TimeoutExpired:
                child.kill()
        return submitit.helpers.DelayedSubmission(RoleJob(self.run_dir, self.role))


def submit_roles(cfg: RunConfig, paths: RunPaths, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Submit one job per role the run needs; role -> job id."""
    saved = dict(os.environ)
    os.environ.update(env or {})   # submitit calls sbatch with this process's environment
    try:
        jobs = {}
        for role in ("sandbox", "trainer", "rollout"):
            if role in roles_needed(cfg):
                jobs[role] = executor(cfg, role, tasks_per_node=1).submit(RoleJob(str(paths.dir), role)).job_id
        return jobs
    finally:
        os.environ.clear()
        os.environ.update(saved)


def submit_command(cfg: RunConfig, role: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                   tasks_per_node: int | None = 1):
    """Run `rstar-hpc ARGV` as a job of ROLE's resources, with this interpreter (a shared venv on clusters)."""
    import submitit

    command = submitit.helpers.CommandFunction([sys.executable, "-m", "rstar_hpc", *argv],
                                               env=dict(env) if env is not None else None)
    return executor(cfg, role, tasks_per_node=tasks_per_node).submit(command)


def wait(job, timeout_s: float = 600, poll_s: float = 1.0):
    """The job's result, or TimeoutError naming the job and its log after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not job.done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"submitit job {job.job_id} not done after {timeout_s:.0f} s; "
                               f"log: {job.paths.stdout} (state {job.state})")
        time.sleep(poll_s)
    return job.result()
