"""A launched run survives what a cluster does to it, mid-step, and ends as if nothing happened.

One run of the all-stage tiny config through sbatch meets, in order:
  1. the time limit (Slurm's B:USR2 to the batch step, as `--signal=B:USR2@lead` sends it) during SFT -> the
     trainer saves, the job requeues itself;
  2. the sandbox's node lost for good (its slurmd and every process on it SIGKILLed, kept down past SlurmdTimeout,
     30 s on this test's own cluster, whose nodes are hosts under root) -> Slurm marks it DOWN and requeues the job,
     which starts again on the nodes that are left (the sandbox on the other cpu node); the requeued job's supervisor
     records the loss and `run status` names it; the node's slurmd is then started again and the node resumed. The
     trainer is frozen (SIGSTOP) meanwhile, as a node's processes are when it hangs: a run without its sandbox goes
     on (its tool calls wait, then fail, and their trajectories run again), and a quiet machine's run once got
     through three stages before Slurm's verdict, leaving the phases below nothing to interrupt; Slurm's SIGCONT and
     TERM at the requeue end it;
  3. `kill -9` of the trainer's process during an RL stage -> the supervisor starts the trainer again in the job;
  4. `kill -9` of the rollout's rank 0 mid-step, once the step's journal holds finished trajectories -> the step
     (all its ranks) goes, the rollout starts again, keeps the journal's trajectories and redoes only the rest;
  5. `scontrol requeue` during a rollout step -> TERM, save, requeue;
  6. `scancel --full --signal=TERM` (what preemption's GraceTime sends) during the hard subset -> save, requeue;
  7. `scancel --signal=KILL --full` mid-step, which Slurm turns into a cancel: TERM to every task, the batch step
     (the supervisor) included, and KILL after KillWait (5 s here), so what has not saved by then dies unsaved ->
     the job stays CANCELLED (the supervisor does not requeue a job Slurm cancelled) and leaves no process of the
     run, not even helpers of the trainer killed in 3; the user relaunches with `rstar-hpc launch RUN/config.yaml`, which continues the run from its directory;
  8. `kill -9` of the sandbox node's slurmd for 10 s while the others keep running, then the daemon comes back.
Then every stage is DONE, every rollout step committed once with the same prompts as the uninterrupted run of
test_launch.py, the trainer at every stage's last step having read each step's trajectories once, and no process
left. A second, short test shows the restart bound (launch.max_restarts) stopping a job with a clear message.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from tests.helpers.launching import KINDS, _tail, check_finished, ci_config, rstar, run_facts, run_processes
from tests.helpers.procfs import alive

from rstar_hpc.launch.status import ACTIVE

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.vllm]


class Run:
    def __init__(self, run: Path, env: dict, job: str):
        self.run, self.env, self.job = run, env, job
        self.log: list[str] = []

    def status(self) -> dict:
        return json.loads(rstar("run", "status", str(self.run), "--json", env=self.env).stdout.splitlines()[-1])

    def heartbeat(self, role: str) -> dict:
        try:
            return json.loads((self.run / "heartbeat" / f"{role}.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def restarts(self) -> int:
        out = subprocess.run(["scontrol", "show", "job", "-o", self.job], capture_output=True, text=True,
                             env=self.env, timeout=30).stdout
        return max((int(t.split("=")[1]) for t in out.split() if t.startswith("Restarts=")), default=0)

    def wait_for(self, what: str, pred, timeout_s: float = 600, poll_s: float = 0.5) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if pred():
                self.log.append(f"{time.strftime('%H:%M:%S')} {what}")
                return
            time.sleep(poll_s)
        raise AssertionError(f"timed out waiting for {what}; so far: {self.log}\n{_tail(self.run)}")

    def stage(self, name: str) -> dict:
        return next(s for s in self.status()["stages"] if s["name"] == name)

    def slurm(self, *argv: str) -> None:
        proc = subprocess.run(list(argv), capture_output=True, text=True, env=self.env, timeout=60)
        assert proc.returncode == 0, f"{argv}: {proc.stderr}"
        self.log.append(f"{time.strftime('%H:%M:%S')} {' '.join(argv)}")


def _journal_mid_step(run: Path) -> bool:
    """A rollout step whose journal holds finished trajectories and whose final commit is not written yet."""
    from rstar_hpc.exchange.rundir import COMMIT_SUFFIX

    for step_dir in (run / "traj").glob("*/step-*"):
        if any(step_dir.glob(f"rollout-part-*{COMMIT_SUFFIX}")) and not (step_dir / f"rollout{COMMIT_SUFFIX}").exists():
            return True
    return False


def _pids(lines: list[str]) -> list[int]:
    return [int(line.split()[0]) for line in lines]


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, IndexError, ValueError):
        return None


def _fresh(r: Run, role: str, since: float) -> bool:
    """The role has said something since `since` (a heartbeat written by a job started after it)."""
    return r.heartbeat(role).get("time", 0) > since


def _rollout_mid_step(r: Run, stage: str) -> bool:
    beat = r.heartbeat("rollout")
    return beat.get("stage") == stage and "step" in beat.get("doing", "") and "committed" not in beat["doing"]


def _node_state(r: Run, node: str) -> str:
    return subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], capture_output=True, text=True, env=r.env,
                          timeout=30).stdout.strip()


def _lose_the_sandbox_node(r: Run, cluster, since: float) -> str:
    """Phase 2: once the requeued job's sandbox serves, its node is lost for good; returns the node once the job runs
    again on the nodes left, `run status` names the loss, and the node is back in the cluster."""
    r.wait_for("the sandbox serving in the requeued job", lambda: (beat := r.status()["roles"].get("sandbox")) and
               time.time() - beat["age_s"] > since and any(j["role"] == "sandbox" and j["state"] == "RUNNING"
                                                           for j in r.status()["jobs"]))
    node = next(j["nodes"] for j in r.status()["jobs"] if j["role"] == "sandbox")
    r.wait_for("the requeued job's trainer", lambda: _fresh(r, "trainer", since) and alive(r.heartbeat("trainer")["pid"]))
    trainer = r.heartbeat("trainer")["pid"]
    os.kill(trainer, signal.SIGSTOP)
    killed = cluster.lose_node(node)
    r.log.append(f"{time.strftime('%H:%M:%S')} trainer {trainer} frozen; node {node} lost: killed slurmd and its steps' "
                 f"processes {killed}")
    r.wait_for(f"Slurm marks {node} DOWN", lambda: _node_state(r, node).startswith("down"), timeout_s=240, poll_s=2)
    r.wait_for("the job requeued onto the nodes left", lambda: r.restarts() >= 2 and any(
        j["role"] == "sandbox" and j["state"] == "RUNNING" and j["nodes"] not in ("", node)
        for j in r.status()["jobs"]), timeout_s=300, poll_s=2)
    r.wait_for("run status names the lost node", lambda: any(f"node {node} lost" in p for p in r.status()["problems"]),
               timeout_s=120, poll_s=2)
    cluster.start_node(node)
    r.wait_for(f"{node} back in service", lambda: _node_state(r, node) in ("idle", "mixed", "allocated"),
               timeout_s=60)
    return node


@pytest.mark.timeout(1800)   # ~11 min on a loaded 2-core machine, and its uninterrupted reference when run alone
def test_a_launched_run_survives_requeues_kills_and_a_node_daemon_crash(chaos_cluster, tiny_model_dir, tmp_path,
                                                                         sbatch_run):
    env = {**chaos_cluster.env, "OMP_NUM_THREADS": "1"}
    config = ci_config(tmp_path, "all-stages", tiny_model_dir)
    cfg = yaml.safe_load(config.read_text())
    cfg["rollout"]["scheduler"]["journal_every_s"] = 0.3   # a step of seconds journals a few parts before it ends
    config.write_text(yaml.safe_dump(cfg))
    info = json.loads(rstar("launch", str(config), "--json", env=env).stdout.splitlines()[-1])
    r = Run(tmp_path / "runs" / "all-stages", env, info["jobs"]["run"])
    orphans: set[int] = set()
    try:
        # 1. the time limit during SFT
        r.wait_for("sft step 4", lambda: r.stage("sft")["step"] >= 4)
        r.slurm("scancel", "--batch", "--signal=USR2", r.job)
        r.wait_for("requeue 1", lambda: r.restarts() >= 1)
        # 2. the sandbox's node lost for good: Slurm marks it DOWN and requeues the job onto the nodes left
        lost = _lose_the_sandbox_node(r, chaos_cluster, since=time.time())
        # 3. kill -9 of the trainer in an RL stage
        r.wait_for("trainer in rl-short", lambda: r.heartbeat("trainer").get("stage") == "rl-short")
        pid = r.heartbeat("trainer")["pid"]
        os.kill(pid, signal.SIGKILL)
        r.log.append(f"kill -9 trainer {pid}")
        r.wait_for("a new trainer", lambda: r.heartbeat("trainer").get("pid") not in (None, pid))
        # 4. kill -9 of the rollout's rank 0 mid-step, once its journal holds finished trajectories
        r.wait_for("a rollout step with a journal part", lambda: _journal_mid_step(r.run), poll_s=0.05)
        pid = r.heartbeat("rollout")["pid"]
        os.kill(pid, signal.SIGKILL)
        r.log.append(f"kill -9 rollout rank 0 {pid}")
        r.wait_for("a new rollout", lambda: r.heartbeat("rollout").get("pid") not in (None, pid) and alive(
            r.heartbeat("rollout")["pid"]))
        # 5. scontrol requeue during a rollout step
        r.wait_for("rollout mid-step", lambda: _rollout_mid_step(r, r.heartbeat("rollout").get("stage")))
        r.slurm("scontrol", "requeue", r.job)
        t_requeue = time.time()
        r.wait_for("requeue 3", lambda: r.restarts() >= 3)
        # 6. preemption's TERM while the requeued job's rollout works
        r.wait_for("rollout working after the requeue", lambda: _fresh(r, "rollout", t_requeue + 1) and
                   _rollout_mid_step(r, r.heartbeat("rollout").get("stage")))
        r.slurm("scancel", "--full", "--signal=TERM", r.job)
        r.wait_for("requeue 4", lambda: r.restarts() >= 4, timeout_s=300)
        # 7. the whole job killed mid-step (Slurm: TERM, KillWait, KILL); it stays dead; the user relaunches
        t_requeue = time.time()   # the TERMed job's roles had exited before it requeued: a newer beat is the new job's
        r.wait_for("rollout working after requeue 4", lambda: _fresh(r, "rollout", t_requeue) and
                   _rollout_mid_step(r, r.heartbeat("rollout").get("stage")))
        # no process of the run escaped its step before: reparented to init, proctrack/linuxproc would never end it
        # (megatron's checkpoint-writer helpers outlived the trainer's kill -9 in 3 until trainer/orphans.py)
        orphans.update(pid for pid in _pids(run_processes(r.run)) if _ppid(pid) == 1)
        assert not orphans, [p for p in run_processes(r.run) if _pids([p])[0] in orphans]
        r.slurm("scancel", "--signal=KILL", "--full", r.job)
        r.wait_for("the killed job over (or requeued)", lambda: r.restarts() > 4 or (r.status()["jobs"] and not any(
            j["state"] in ACTIVE for j in r.status()["jobs"])), timeout_s=120)
        assert r.restarts() == 4 and {j["state"] for j in r.status()["jobs"]} == {"CANCELLED"}, r.status()["jobs"]
        try:
            r.wait_for("no process of the run left", lambda: not run_processes(r.run), timeout_s=60)
        except AssertionError as e:
            raise AssertionError(f"{e}\nleft: {run_processes(r.run)}") from None
        assert any("resumes it" in p for p in r.status()["problems"]), r.status()["problems"]
        info = json.loads(rstar("launch", str(r.run / "config.yaml"), "--json", env=env).stdout.splitlines()[-1])
        r.job = info["jobs"]["run"]
        r.log.append(f"{time.strftime('%H:%M:%S')} relaunched: job {r.job}")
        # 8. the sandbox node's slurmd dies while the run goes on, and comes back
        r.wait_for("rollout running again", lambda: r.status()["stages"][-1]["state"] != "done" and any(
            j["state"] == "RUNNING" for j in r.status()["jobs"]))
        node = next(j["nodes"] for j in r.status()["jobs"] if j["role"] == "sandbox")
        chaos_cluster.kill_node(node)
        r.log.append(f"kill -9 slurmd {node}")
        time.sleep(10)
        chaos_cluster.start_node(node)
        r.log.append(f"slurmd {node} back")
        r.wait_for("the run done", lambda: r.status()["done"], timeout_s=1200)
    finally:
        print("\n".join(r.log))
        for pid in orphans & set(_pids(run_processes(r.run))):   # a failed test's leak: end it
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    st = r.status()
    assert st["done"], (st, r.log, _tail(r.run))
    facts = check_finished(r.run, env)
    assert facts["uids"] == run_facts(sbatch_run[0])["uids"], "the interrupted run drew other prompts"
    for stage, (step, cursor, consumers) in facts["trainer"].items():
        kind = KINDS[[s["name"] for s in cfg["stages"]].index(stage)]
        if kind == "rl":   # the trainer read each step's trajectories once, to the end
            assert consumers.get("trainer") == step, (stage, consumers)
    assert any(f["kind"] == "node_lost" and f["host"] == lost for f in st["faults"]), st["faults"]
    kept = [json.loads(line)["kept_from_journal"] for line in (r.run / "metrics" / "rollout.jsonl").open()]
    assert sum(kept) > 0, "no rollout step kept its journal across a kill"


def test_restart_bound_stops_the_job_with_a_clear_message(slurm_cluster, tiny_model_dir, tmp_path):
    env = {**slurm_cluster.env, "OMP_NUM_THREADS": "1"}
    config = ci_config(tmp_path, "bounded", tiny_model_dir, max_restarts=0)
    cfg = yaml.safe_load(config.read_text())
    cfg["stages"] = [{"name": "sft", "kind": "sft", "num_steps": 200, "prompts_per_step": 8, "data": "demo"}]
    config.write_text(yaml.safe_dump(cfg))
    info = json.loads(rstar("launch", str(config), "--json", env=env).stdout.splitlines()[-1])
    r = Run(tmp_path / "runs" / "bounded", env, info["jobs"]["run"])
    r.wait_for("the trainer training", lambda: r.stage("sft")["state"] == "running", timeout_s=300)
    r.slurm("scontrol", "requeue", r.job)
    r.wait_for("the job over", lambda: all(j["state"] in ("FAILED", "COMPLETED") for j in r.status()["jobs"])
               and r.restarts() >= 1, timeout_s=300)
    out = "".join(p.read_text() for p in (r.run / "logs").glob("run-*.out"))
    assert "requeued 1 times, more than launch.max_restarts=0: not starting again" in out, out[-2000:]
    st = r.status()
    assert not st["done"] and any("resumes it" in p for p in st["problems"]), st["problems"]
