"""A role that hangs without dying (SIGSTOP) is restarted by its launcher once its heartbeat is older than
launch.hang_timeout_s, with a message saying what it was doing and for how long; the restart counts against
launch.role_restarts like a crash; and an srun step whose task is stopped is really ended (Slurm's own kill).

The supervisor here is the real one (rstar_hpc.launch.supervise.Supervisor) with one change: its trainer "step" is a
small script instead of srun (the srun kill is shown on the emulated cluster by the last test). The script writes
the trainer's heartbeat as rank 0 does, then stops itself with SIGSTOP on its first start; on its second it marks
the trainer's stages done, as a trainer that caught up would."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rstar_hpc.config import ConfigError, load_config
from rstar_hpc.exchange.events import read_events
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.launch.slurm import job_state
from rstar_hpc.launch.status import faults
from rstar_hpc.launch.supervise import Supervisor
from rstar_hpc.launch.watch import kill_step

REPO = Path(__file__).resolve().parents[2]

ROLE = r"""
import os, signal, sys
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.state import StageState, write_heartbeat, write_stage_state
run, counter, hang_on, stages = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4].split(",")
attempt = len(open(counter).read()) + 1 if os.path.exists(counter) else 1
open(counter, "a").write("x")
paths = RunPaths(run)
write_heartbeat(paths, "trainer", f"stage rl: training on the trajectories of step {attempt}", phase="train")
if str(attempt) in hang_on:
    os.kill(os.getpid(), signal.SIGSTOP)   # hung: alive, silent
for s in stages:
    write_stage_state(paths, StageState(stage=s, status="DONE"))
"""


class ScriptSupervisor(Supervisor):
    """The real supervisor, its trainer step a script (no srun: the kill is then its process group's SIGKILL)."""

    def __init__(self, cfg, paths, hang_on: str):
        super().__init__(cfg, paths, {"trainer": 0})
        self.hang_timeout_s = 3.0   # the config refuses under 60 s; the mechanism is the same
        self.counter = paths.dir / "attempts"
        self.hang_on = hang_on

    def step_argv(self, role):
        stages = ",".join(s.name for s in self.cfg.stages if s.kind in ("sft", "rl"))
        return [sys.executable, "-c", ROLE, str(self.paths.dir), str(self.counter), self.hang_on, stages]

    def step_env(self, role):
        return {**os.environ, "PYTHONPATH": str(REPO)}


def _supervise(tmp_path, monkeypatch, hang_on: str, role_restarts: int):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)   # nothing to requeue
    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}", "run.name=hang", f"launch.role_restarts={role_restarts}"])
    paths = RunPaths(tmp_path / "hang")
    paths.logs.mkdir(parents=True)
    sup = ScriptSupervisor(cfg, paths, hang_on)
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)}
    t0 = time.monotonic()
    try:
        code = sup.run()
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    return sup, paths, code, time.monotonic() - t0


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_sigstopped_role_is_killed_and_restarted_saying_what_it_did(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="rstar_hpc.launch")
    sup, paths, code, wall = _supervise(tmp_path, monkeypatch, hang_on="1", role_restarts=1)
    assert code == 0 and "trainer" in sup.done
    assert (paths.dir / "attempts").read_text() == "xx"   # started again once, and that one finished
    assert sup.restarts["trainer"] == 1   # counted like a crash
    (hang,) = [e for e in read_events(paths) if e["kind"] == "hang"]
    assert hang["role"] == "trainer" and hang["phase"] == "train" and hang["silent_s"] >= 3.0
    assert hang["doing"] == "stage rl: training on the trajectories of step 1"
    assert not [e for e in read_events(paths) if e["kind"] != "hang"]   # the hang is its own record, no crash too
    said = [r.getMessage() for r in caplog.records if "hung" in r.getMessage()]
    assert any("no heartbeat for" in m and "training on the trajectories of step 1" in m for m in said), said
    (text,) = [f["text"] for f in faults(paths)]
    assert text.startswith("role trainer hung in phase train for ") and text.endswith(", restarted (stage rl: "
                                                                                      f"training on the trajectories of step 1; host {os.uname().nodename})")
    assert wall < 60, wall   # 3 s stale + a 5 s restart delay + two interpreter starts, on a loaded machine


def test_a_role_that_keeps_hanging_uses_up_role_restarts(tmp_path, monkeypatch):
    sup, paths, code, _ = _supervise(tmp_path, monkeypatch, hang_on="1,2", role_restarts=0)
    assert code == 1 and sup.failed   # no requeue: the job fails, saying so
    assert (paths.dir / "attempts").read_text() == "x"
    kinds = [e["kind"] for e in read_events(paths)]
    assert kinds == ["hang", "gave_up"], kinds
    assert any("failed 1x, more than launch.role_restarts=0" in f["text"] for f in faults(paths))


WAIT_FOR_A_NEW_SANDBOX = r"""
import sys, time
from rstar_hpc.exchange.rendezvous import read_announcements
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.state import StageState, write_heartbeat, write_stage_state
run, first_pid, stages = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
paths = RunPaths(run)
deadline = time.time() + 120
while not any(a["pid"] != first_pid for a in read_announcements(run, "sandbox")):   # the restarted service
    assert time.time() < deadline, "no new sandbox service"
    write_heartbeat(paths, "trainer", "waiting for the sandbox", phase="wait")
    time.sleep(0.2)
for s in stages:
    write_stage_state(paths, StageState(stage=s, status="DONE"))
"""


def test_a_sandbox_service_that_stops_answering_is_restarted(tmp_path, monkeypatch):
    """A real sandbox service, SIGSTOPped once it announced itself: alive, its announcements (the role's heartbeat,
    refreshed every sandbox.stats_interval_s) go stale; the supervisor kills the step and starts a fresh service,
    recorded as a hang of the sandbox role. The trainer stand-in finishes once the new service is announced."""
    import threading

    from rstar_hpc.exchange.rendezvous import read_announcements

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}", "run.name=sbx", "launch.role_restarts=1",
                                   "launch.hang_timeout_s=0", "sandbox.stats_interval_s=0.5"])
    paths = RunPaths(tmp_path / "sbx")
    paths.logs.mkdir(parents=True)
    stages = ",".join(s.name for s in cfg.stages if s.kind in ("sft", "rl"))
    stopped: list[int] = []

    class SandboxSupervisor(Supervisor):
        def step_argv(self, role):
            if role == "sandbox":
                return [sys.executable, "-m", "rstar_hpc", "sandbox", "serve", "--run-dir", str(paths.dir),
                        "--workers", "1", "--host", "127.0.0.1", "--name", "cpu-test", "--stats-interval", "0.5"]
            while not stopped:   # the trainer starts once the first service is stopped (below)
                time.sleep(0.1)
            return [sys.executable, "-c", WAIT_FOR_A_NEW_SANDBOX, str(paths.dir), str(stopped[0]), stages]

        def step_env(self, role):
            return {**os.environ, "PYTHONPATH": str(REPO)}

    def stop_the_first_service():
        deadline = time.monotonic() + 120
        while not read_announcements(paths.dir, "sandbox"):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        pid = read_announcements(paths.dir, "sandbox")[0]["pid"]
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    stopper = threading.Thread(target=stop_the_first_service, daemon=True)
    stopper.start()
    sup = SandboxSupervisor(cfg, paths, {"sandbox": 0, "trainer": 1})
    sup.hang_timeout_s = 3.0   # the config refuses under 60 s; the mechanism is the same
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)}
    try:
        code = sup.run()
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    assert code == 0 and "trainer" in sup.done and stopped
    (hang,) = [e for e in read_events(paths) if e["kind"] == "hang"]
    assert hang["role"] == "sandbox" and hang["phase"] == "serve" and hang["silent_s"] >= 3.0
    assert hang["doing"].startswith("sandbox service cpu-test serving")
    assert sup.restarts["sandbox"] == 1 and sup.starts["sandbox"] == 2
    assert _gone(stopped[0])   # the stopped service was killed, not left behind
    assert any(f["text"].startswith("role sandbox hung in phase serve") for f in faults(paths))


def test_hang_timeout_is_checked():
    with pytest.raises(ConfigError, match="hang_timeout_s"):
        load_config("tiny-cpu", ["launch.hang_timeout_s=5"])
    assert load_config("tiny-cpu", ["launch.hang_timeout_s=0"]).launch.hang_timeout_s == 0


@pytest.mark.slurm
def test_kill_step_ends_an_srun_step_whose_task_is_stopped(slurm_cluster, tmp_path):
    """srun -> slurmstepd -> a task that stopped itself: two SIGINTs to srun make Slurm end the step (the task
    dies of SIGKILL although stopped), and srun exits; nothing of the step is left."""
    pid_file = tmp_path / "pid"
    argv = ["srun", "--job-name=rstar-kill-step-test", "--nodes=1", "--ntasks=1", "--partition=cpu", sys.executable, "-c",
            f"import os, signal; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
            "os.kill(os.getpid(), signal.SIGSTOP)"]
    proc = subprocess.Popen(argv, env=slurm_cluster.env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, "the step did not start"
            time.sleep(0.2)
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "T":
            assert time.monotonic() < deadline, "the task did not stop"
            time.sleep(0.1)
        t0 = time.monotonic()
        kill_step(proc, argv, grace_s=60)
        assert proc.returncode is not None and time.monotonic() - t0 < 60
        deadline = time.monotonic() + 30
        while not _gone(pid):
            assert time.monotonic() < deadline, f"task {pid} outlived its step"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    jobs = subprocess.run(["squeue", "-h", "-n", "rstar-kill-step-test", "-o", "%i %T"], env=slurm_cluster.env,
                          capture_output=True, text=True, timeout=30).stdout
    assert "RUNNING" not in jobs, jobs


def test_submitit_rolejob_restarts_a_sigstopped_role_too(tmp_path, monkeypatch):
    """The submitit launcher's RoleJob runs the same check on its child (here the script, as one task)."""
    from rstar_hpc.config import dump_config
    from rstar_hpc.launch.submitit_launch import RoleJob

    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}", "run.name=hang", "launch.role_restarts=1"])
    paths = RunPaths(tmp_path / "hang")
    paths.dir.mkdir(parents=True)
    (paths.dir / "config.yaml").write_text(dump_config(cfg))
    stages = ",".join(s.name for s in cfg.stages if s.kind in ("sft", "rl"))

    class ScriptRoleJob(RoleJob):
        def argv(self, cfg, attempt):
            return ([sys.executable, "-c", ROLE, self.run_dir, str(paths.dir / "attempts"), "1", stages],
                    {**os.environ, "PYTHONPATH": str(REPO)})

    job = ScriptRoleJob(str(paths.dir), "trainer")
    job.hang_timeout_s = 3.0
    assert job() == "trainer: every stage of the role is done"
    assert (paths.dir / "attempts").read_text() == "xx"
    (hang,) = read_events(paths)
    assert hang["kind"] == "hang" and hang["phase"] == "train" and hang["role"] == "trainer"


SUPERVISOR = r"""
import os, signal, subprocess, sys, time
# as Supervisor.start does: a role's step is an srun in a session of its own
subprocess.Popen(["srun", "--nodes=1", "--ntasks=1", sys.executable, "-c",
                  "import os, time; open(%r, 'w').write(str(os.getpid())); time.sleep(600)" % sys.argv[1]],
                 start_new_session=True)
while not (os.path.exists(sys.argv[1]) and open(sys.argv[1]).read()):
    time.sleep(0.1)
os.kill(os.getpid(), signal.SIGKILL)   # the supervisor dies: no handler, no cleanup
"""


@pytest.mark.slurm
def test_when_the_supervisor_dies_its_roles_die_with_the_job(slurm_cluster, tmp_path):
    """The batch step execs the supervisor (sbatch/run.sbatch); killed, it ends the batch step, so Slurm ends the
    job and every step in it: a role's task left running would hold its GPUs and write into the run directory
    beside a relaunched one."""
    pid_file, script = tmp_path / "pid", tmp_path / "supervisor.py"
    script.write_text(SUPERVISOR)
    batch = tmp_path / "job.sbatch"
    batch.write_text(f"#!/bin/bash\n#SBATCH --partition=cpu\n#SBATCH --nodes=1\n#SBATCH --ntasks=1\n"
                     f"#SBATCH --output={tmp_path}/job.out\nexec {sys.executable} {script} {pid_file}\n")
    out = subprocess.run(["sbatch", "--parsable", "--job-name=rstar-supervisor-dies", str(batch)],
                         env=slurm_cluster.env, capture_output=True, text=True, timeout=60, check=True)
    job = out.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 120
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline, (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() \
            else "the role step never started"
        time.sleep(0.2)
    pid = int(pid_file.read_text())
    while True:
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=slurm_cluster.env, capture_output=True,
                               text=True, timeout=30).stdout.strip()
        if state in ("", "COMPLETED", "FAILED") and _gone(pid):
            break
        assert time.monotonic() < deadline, f"job {job} is {state!r}, role task {pid} gone: {_gone(pid)}"
        time.sleep(0.5)


CANCELLED = r"""
import logging, os, sys
from rstar_hpc.config import load_config
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.launch.supervise import Supervisor

logging.basicConfig(level=logging.INFO, format="%(message)s")
root, up = sys.argv[1], sys.argv[2]
cfg = load_config("tiny-cpu", [f"run.root={root}", "run.name=cancelled"])
paths = RunPaths(os.path.join(root, "cancelled"))
paths.logs.mkdir(parents=True, exist_ok=True)


class StandIn(Supervisor):   # the real supervisor; its trainer a process that waits, as one between saves does
    def step_argv(self, role):
        return [sys.executable, "-c", "import time; open(%r, 'w').write('up'); time.sleep(600)" % up]

    def step_env(self, role):
        return dict(os.environ)


sys.exit(StandIn(cfg, paths, {"trainer": 0}).run())
"""


@pytest.mark.slurm
def test_a_job_slurm_cancelled_is_not_requeued_by_its_supervisor(slurm_cluster, tmp_path):
    """`scancel --signal=KILL --full` is a cancel to Slurm: TERM to every step (the batch step too), KILL after
    KillWait. The supervisor passes the TERM on and its roles stop within KillWait, as they do for a requeue; Slurm
    would requeue even a cancelled batch job when asked (`scontrol requeue`), so the supervisor must not ask: the
    job stays CANCELLED and `rstar-hpc launch RUN/config.yaml` is how the run goes on."""
    script, up, batch = tmp_path / "supervisor.py", tmp_path / "up", tmp_path / "job.sbatch"
    script.write_text(CANCELLED)
    batch.write_text(f"#!/bin/bash\n#SBATCH --partition=cpu\n#SBATCH --nodes=1\n#SBATCH --ntasks=1\n#SBATCH --requeue\n"
                     f"#SBATCH --output={tmp_path}/job.out\nexec {sys.executable} {script} {tmp_path} {up}\n")
    out = subprocess.run(["sbatch", "--parsable", "--job-name=rstar-cancelled", str(batch)], env=slurm_cluster.env,
                         capture_output=True, text=True, timeout=60, check=True)
    job = out.stdout.strip().split(";")[0]
    log = tmp_path / "job.out"
    deadline = time.monotonic() + 120
    while not (up.exists() and "starting trainer" in (log.read_text() if log.exists() else "")):
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "the job never started"
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=KILL", "--full", job], env=slurm_cluster.env, timeout=30, check=True)
    while True:
        fields = job_state(job, slurm_cluster.env)
        if fields.get("JobState") not in ("RUNNING", "COMPLETING", None) or int(fields.get("Restarts", 0)):
            break
        assert time.monotonic() < deadline, fields
        time.sleep(0.5)
    assert fields["JobState"] == "CANCELLED" and fields["Restarts"] == "0", (fields, log.read_text())
    assert f"job {job} is COMPLETING in Slurm (a scancel, or a requeue Slurm does itself): not requeueing it" in \
        log.read_text(), log.read_text()
