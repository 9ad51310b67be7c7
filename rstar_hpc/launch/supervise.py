"""The supervisor of a run's heterogeneous job (the batch step of sbatch/run.sbatch):

    python -m rstar_hpc.launch.supervise RUN_DIR

- refuses to start past `launch.max_restarts` requeues (SLURM_RESTART_COUNT), saying so;
- starts each role the run still needs as a job step on its het group (`srun --het-group=N`), the sandbox first;
- a role whose step ends before the role is done (a crash, a kill -9 of one of its processes) is started again,
  up to `launch.role_restarts` times, while the others keep running: it resumes from the run directory;
- a trainer or rollout whose heartbeat is older than `launch.hang_timeout_s` (hung: SIGSTOPped, deadlocked, stuck
  on a file system) has its step killed and is started again the same way, counted against the same bound; if its
  srun hangs too, the step is cancelled through Slurm first (watch.kill_step), so the new srun is not left pending;
- a role that refuses its config or inputs (exit 78, or its RUN/launch/refused-<role>.json: cli/exit_codes.Refused)
  is not started again: no restart can fix that; the supervisor records a `refused` event with the role's error,
  stops the other roles as when one fails too often, and ends the job without a requeue;
- a role whose step ends because one of its nodes is lost (Slurm holds it DOWN or not responding) is not started
  again on it: the supervisor records a `node_lost` event and stops the job for a requeue (Slurm requeues a job on a
  node it marks DOWN by itself), so the job starts again on the nodes that are left; the requeued job's supervisor
  records the loss if the old one did not live to (launch/nodes.py);
- every restart, hang, node loss and give-up is appended to RUN/launch/events.jsonl (exchange/events.py) for
  `run status`;
- USR2 (Slurm's pre-timeout signal, --signal=B:USR2@lead) and TERM (preemption's grace time, scancel
  --signal=TERM, scontrol requeue) are passed to the trainer and rollout steps, which save and exit; once they
  have, the sandbox is stopped and the job requeues itself, unless the run is done, `run cancel` was used, or Slurm
  is ending the job itself (COMPLETING: `scancel` or `scancel --signal=KILL`, which send TERM, then KILL after
  KillWait; `scontrol requeue`, which requeues it anyway);
- when every stage is done it stops the sandbox and ends the job successfully.
Everything it does is logged to the job's output (RUN/logs/run-<job>.out).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rstar_hpc.cli.exit_codes import EXIT_REFUSED, refusal
from rstar_hpc.exchange.events import record_event
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.launch import placement
from rstar_hpc.launch.nodes import lost_nodes, note_requeue_after_node_loss
from rstar_hpc.launch.record import cancelled
from rstar_hpc.launch.roles import hostnames, role_done, role_env, roles_needed, run_done
from rstar_hpc.launch.slurm import job_state
from rstar_hpc.launch.watch import end_step, kill_step, named_step, stale

log = logging.getLogger("rstar_hpc.launch")
STABLE_S = 600.0   # a role that ran this long before failing starts its restart count afresh


class Supervisor:
    def __init__(self, cfg, paths: RunPaths, groups: dict[str, int]):
        self.cfg, self.paths, self.groups = cfg, paths, groups
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts = dict.fromkeys(groups, 0)
        self.starts = dict.fromkeys(groups, 0)
        self.started_at = dict.fromkeys(groups, 0.0)
        self.started_wall = dict.fromkeys(groups, 0.0)   # heartbeats are wall times
        self.argv: dict[str, list[str]] = {}
        self.hang_timeout_s = cfg.launch.hang_timeout_s
        self.done: set[str] = set()
        self.stop_reason: str | None = None
        self.stop_at = 0.0
        self.failed = False   # a role ended more often than launch.role_restarts: the job fails, no requeue
        self.refused: str | None = None   # the role that refused its inputs: the job fails at once, no requeue
        self.log_of: dict[str, Path] = {}

    # ------------------------------------------------------------------------------------------------ steps
    def step_argv(self, role: str) -> list[str]:
        # a job of one component (a run of sft stages only) is no hetjob: srun refuses --het-group there
        group = self.groups[role] if len(self.groups) > 1 else None
        # named: a step whose srun hangs is then cancelled through Slurm (watch.kill_step)
        return named_step(placement.step_argv(self.cfg, role, self.paths.dir, het_group=group), role)

    def step_env(self, role: str) -> dict[str, str]:
        nodes = self._nodes(role)
        env = role_env(self.cfg, role, nodes, self.starts[role])
        if role == "rollout" and self.cfg.launch.mpi.start != "none":
            env["SLURM_HOSTFILE"] = str(placement.write_hostfile(self.cfg, self.paths.dir, hostnames(nodes)))
        return env

    def start(self, role: str) -> None:
        self.log_of[role] = self.paths.logs / f"{role}-{os.environ.get('SLURM_JOB_ID', 'local')}.log"
        out = open(self.log_of[role], "ab")  # noqa: SIM115
        argv = self.step_argv(role)
        self.starts[role] += 1
        log.info("starting %s: %s", role, " ".join(argv))
        self.started_at[role] = time.monotonic()
        self.started_wall[role] = time.time()
        self.argv[role] = argv
        self.procs[role] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                            env=self.step_env(role))

    def signal_role(self, role: str, sig: int) -> None:
        proc = self.procs.get(role)
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(sig)   # srun passes it on to every task of the step
            except ProcessLookupError:
                pass

    # ------------------------------------------------------------------------------------------------ signals
    def on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.stop_reason is None:
            self.stop_reason = {"SIGUSR2": "the time limit is near (USR2)"}.get(name, f"{name} from Slurm")
            self.stop_at = time.monotonic()
            log.warning("%s: asking the trainer and the rollout to save and stop", self.stop_reason)
        for role in ("trainer", "rollout"):
            self.signal_role(role, signal.SIGUSR2 if name == "SIGUSR2" else signal.SIGTERM)

    # ------------------------------------------------------------------------------------------------ the loop
    def run(self) -> int:
        for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.on_signal)
        for e in note_requeue_after_node_loss(self.paths, {r: self._nodes(r) for r in self.groups}):
            log.warning("node %s of the %s was lost (%s: %s): Slurm requeued the job; now on %s", e["host"],
                        e["role"], e["state"], e["reason"] or "?", e["now_on"])
        for role in ("sandbox", "trainer", "rollout"):
            if role in self.groups and not (role != "sandbox" and role_done(self.cfg, self.paths, role)):
                self.start(role)
            elif role in self.groups:
                self.done.add(role)
        workers = [r for r in ("trainer", "rollout") if r in self.groups]
        while True:
            time.sleep(1.0)
            for role in workers:
                self.check(role)
                self.check_hang(role)
            if "sandbox" in self.groups and self.stop_reason is None and self.procs["sandbox"].poll() is not None:
                self.restart("sandbox", self.procs["sandbox"].returncode)
            elif "sandbox" in self.groups:
                self.check_hang("sandbox")   # a service alive but not answering (its announcements go stale)
            if all(r in self.done for r in workers):
                break
            if self.stop_reason and all(self.procs[r].poll() is not None for r in workers if r in self.procs):
                break
            if self.stop_reason and time.monotonic() - self.stop_at > max(30, self.cfg.launch.signal_lead_s - 15):
                log.error("roles still running %.0fs after %s; killing them", time.monotonic() - self.stop_at,
                          self.stop_reason)
                for role in workers:
                    self.signal_role(role, signal.SIGKILL)
        return self.finish()

    def check(self, role: str) -> None:
        proc = self.procs.get(role)
        if role in self.done or proc is None or proc.poll() is None:
            return
        if role_done(self.cfg, self.paths, role):
            log.info("%s: every stage of the role is done", role)
            self.done.add(role)
        elif self.stop_reason is None:
            self.restart(role, proc.returncode)

    def check_hang(self, role: str) -> None:
        """A running role whose heartbeat went stale: kill its step, then restart it like a crash."""
        proc = self.procs.get(role)
        if self.stop_reason is not None or role in self.done or proc is None or proc.poll() is not None:
            return
        hung = stale(self.paths, role, self.started_wall[role], self.hang_timeout_s)
        if hung is None:
            return
        log.error("%s hung: no heartbeat for %.0f s (more than launch.hang_timeout_s=%g), last doing: %s (host %s); "
                  "killing its step and starting it again", role, hung["silent_s"], self.hang_timeout_s,
                  hung["doing"], hung["host"] or "?")
        record_event(self.paths, "hang", role=role, **hung, timeout_s=self.hang_timeout_s)
        kill_step(proc, self.argv.get(role, []))
        self.restart(role, proc.returncode, hung=hung)

    def _nodes(self, role: str) -> str | None:
        return os.environ.get(f"SLURM_JOB_NODELIST_HET_GROUP_{self.groups[role]}", os.environ.get("SLURM_JOB_NODELIST"))

    def restart(self, role: str, code: int, hung: dict | None = None) -> None:
        if hung is None and (code == EXIT_REFUSED or refusal(self.paths, role)):
            self.refuse(role, code)
            return
        # a hung role's silence is no running: one that hangs again soon after each start is a loop too
        if time.monotonic() - self.started_at[role] - (hung["silent_s"] if hung else 0.0) > STABLE_S:
            self.restarts[role] = 0   # it ran a good while: a new failure, not a crash loop
        lost = lost_nodes(self._nodes(role))
        if lost:   # starting it again would put it on a dead node: the job must requeue onto the nodes left
            self.node_lost(role, code, lost)
            return
        self.restarts[role] += 1
        if hung is None:   # a hang was recorded with what it was doing
            record_event(self.paths, "crash", role=role, host=self._nodes(role), exit=code,
                         restart=self.restarts[role])
        if self.restarts[role] > self.cfg.launch.role_restarts:
            record_event(self.paths, "gave_up", role=role, host=self._nodes(role), exit=code,
                         restarts=self.restarts[role] - 1, limit=self.cfg.launch.role_restarts)
            log.error("%s ended (exit %s) %d times in this job, more than launch.role_restarts=%d; stopping the "
                      "job (see RUN/logs/%s-*.log)", role, code, self.restarts[role], self.cfg.launch.role_restarts,
                      role)
            self.stop_reason = self.stop_reason or f"{role} failed"
            self.stop_at = self.stop_at or time.monotonic()
            self.failed = True
            self.on_signal(signal.SIGTERM, None)
            return
        delay = min(60, 5 * 2 ** (self.restarts[role] - 1))
        log.warning("%s %s before its stages were done; starting it again in %d s (%d/%d); it resumes from the run "
                    "directory", role, "hung" if hung else f"ended (exit {code})", delay, self.restarts[role],
                    self.cfg.launch.role_restarts)
        if self.wait_unless_stopped(delay):
            log.warning("%s during %s's restart back-off: not starting it (it would be killed before it could "
                        "save)", self.stop_reason, role)
            return
        self.start(role)

    def refuse(self, role: str, code: int) -> None:
        """The role refused its config or inputs: starting it again would refuse again. Stop the job, no requeue."""
        found = refusal(self.paths, role)
        why = found["message"] if found else _tail(self.log_of.get(role))
        record_event(self.paths, "refused", role=role, host=self._nodes(role), exit=code, message=why)
        log.error("%s refused to run (exit %s): %s\nno restart can fix this: stopping the job without a requeue. Fix the "
                  "config or the input named above, then `rstar-hpc launch %s [key=value ...]` continues the run",
                  role, code, why, self.paths.config)
        self.refused = role
        self.stop_reason = self.stop_reason or f"{role} refused its config or inputs"
        self.stop_at = self.stop_at or time.monotonic()
        self.on_signal(signal.SIGTERM, None)

    def wait_unless_stopped(self, seconds: float) -> bool:
        """Sleep `seconds`, ending early when a stop (USR2, TERM, a failed role) arrives; whether one did. The
        signal handler runs between the short sleeps."""
        deadline = time.monotonic() + seconds
        while self.stop_reason is None and time.monotonic() < deadline:
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        return self.stop_reason is not None

    def node_lost(self, role: str, code: int, lost: dict[str, tuple[str, str]]) -> None:
        for node, (state, reason) in lost.items():
            record_event(self.paths, "node_lost", role=role, host=node, state=state, reason=reason, exit=code,
                         requeued=False)
        log.error("%s ended (exit %s) and its node(s) %s are lost in Slurm (%s): not starting it there; stopping the "
                  "job so that it requeues onto the nodes that are left", role, code, ",".join(lost),
                  "; ".join(f"{n}: {s} {r}".strip() for n, (s, r) in lost.items()))
        self.stop_reason = self.stop_reason or f"node {','.join(lost)} lost"
        self.stop_at = self.stop_at or time.monotonic()
        self.on_signal(signal.SIGTERM, None)

    def finish(self) -> int:
        proc = self.procs.get("sandbox")
        if proc is not None and proc.poll() is None:
            end_step(proc, self.argv.get("sandbox", []))   # each service closes its pool and removes its scratch
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        if run_done(self.cfg, self.paths):
            log.info("run %s: every stage is done", self.paths.name)
            return 0
        if self.refused:
            return EXIT_REFUSED
        if self.failed:
            return 1
        if cancelled(self.paths):
            log.warning("run cancelled (rstar-hpc run cancel): not requeueing; `rstar-hpc launch` resumes it")
            return 0
        job = os.environ.get("SLURM_JOB_ID")
        ending = _ending_in_slurm(job) if job else None
        if ending:   # Slurm would requeue even a cancelled batch job on request: a user's scancel must stay a cancel
            log.warning("job %s is %s in Slurm (a scancel, or a requeue Slurm does itself): not requeueing it; if it "
                        "does not come back, `rstar-hpc launch %s` continues the run", job, ending, self.paths.config)
            return 0
        log.warning("%s before the run was done: requeueing job %s; it resumes where this one stopped",
                    self.stop_reason or "stopped", job)
        if job:
            subprocess.run(["scontrol", "requeue", job], check=False)
        return 0


def _tail(log: Path | None, lines: int = 8, limit: int = 2000) -> str:
    """The last lines of a role's log: what it said before it refused (when it left no refusal record)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
            text = f.read().decode(errors="replace")
    except (OSError, TypeError):
        return "see RUN/logs/"
    return "\n".join(text.strip().splitlines()[-lines:])[-limit:]


def _ending_in_slurm(job: str) -> str | None:
    """The job's state when Slurm itself is ending it: COMPLETING after `scancel` (with or without --signal=KILL:
    TERM, KillWait, KILL), `scontrol requeue`, or the time limit. None while it runs: a TERM alone (preemption's grace
    time, `scancel --signal=TERM`) or USR2 leaves it RUNNING, and the supervisor requeues it."""
    try:
        state = job_state(job).get("JobState")
    except (OSError, subprocess.SubprocessError):
        return None   # Slurm did not answer: requeue as before (`rstar-hpc run cancel` still stops the run)
    return state if state and state not in ("RUNNING", "SUSPENDED") else None


def main(run_dir: str) -> int:
    from rstar_hpc.config import ConfigError, load_config
    from rstar_hpc.logs import init_logging

    init_logging("supervisor", 0)
    paths = RunPaths(run_dir)
    try:
        cfg = load_config(str(paths.config))
    except ConfigError as e:   # no role could start: no requeue either
        log.error("%s refused: %s\nfix it, then `rstar-hpc launch %s [key=value ...]` continues the run", paths.config,
                  e, paths.config)
        record_event(paths, "refused", role="supervisor", message=str(e))
        return EXIT_REFUSED
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    if restarts > cfg.launch.max_restarts:
        log.error("job %s was requeued %d times, more than launch.max_restarts=%d: not starting again. The run "
                  "directory is intact; `rstar-hpc launch %s` (with a higher launch.max_restarts if it keeps "
                  "stopping) continues it", os.environ.get("SLURM_JOB_ID"), restarts, cfg.launch.max_restarts,
                  paths.dir / "config.yaml")
        return 1
    groups = dict(item.split("=") for item in os.environ["RSTAR_HET_GROUPS"].split(",")) \
        if os.environ.get("RSTAR_HET_GROUPS") else {r: i for i, r in enumerate(roles_needed(cfg))}
    return Supervisor(cfg, paths, {r: int(i) for r, i in groups.items()}).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
