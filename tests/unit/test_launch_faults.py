"""The launchers' fault record (RUN/launch/events.jsonl) as `run status` names it, and the hang check's reading of a
heartbeat. The processes behind them (a SIGSTOPped role, a killed sandbox service) are in
tests/integration/test_hang_restart.py and tests/sandbox/test_network.py."""
from __future__ import annotations

import json
import multiprocessing
import time

import pytest

from rstar_hpc.exchange.events import read_events, record_event
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.state import write_heartbeat
from rstar_hpc.launch.status import faults
from rstar_hpc.launch.watch import stale


def _append_many(run_dir: str, n: int, tag: int) -> None:
    for i in range(n):
        record_event(RunPaths(run_dir), "crash", role="sandbox", host=f"cpu{tag}", exit=-9, restart=i, pad="x" * 500)


def test_concurrent_appenders_lose_no_line_and_mix_none(tmp_path):
    """Three launchers (submitit's RoleJobs) append at once: every event is there, whole."""
    procs = [multiprocessing.get_context("fork").Process(target=_append_many, args=(str(tmp_path), 100, t))
             for t in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    events = read_events(RunPaths(tmp_path))
    assert len(events) == 300
    assert sorted(sum(1 for e in events if e["host"] == f"cpu{t}") for t in range(3)) == [100] * 3


def test_a_line_cut_by_a_kill_is_skipped(tmp_path):
    paths = RunPaths(tmp_path)
    record_event(paths, "crash", role="trainer", host="gpu1", exit=1)
    with open(paths.launch_events, "a") as f:
        f.write('{"time": 1, "kind": "cra')
    assert [e["role"] for e in read_events(paths)] == ["trainer"]


def test_faults_name_what_happened(tmp_path):
    paths = RunPaths(tmp_path)
    now = time.time()
    old = {"time": now - 7200, "kind": "crash", "role": "trainer", "host": "gpu1", "exit": 1}
    paths.launch_events.parent.mkdir(parents=True)
    paths.launch_events.write_text(json.dumps(old) + "\n")   # older than the window: not shown
    record_event(paths, "crash", role="sandbox", host="cpu1", exit=-9, restart=1)
    record_event(paths, "crash", role="sandbox", host="cpu1", exit=-9, restart=2)
    record_event(paths, "hang", role="rollout", host="gpu2", silent_s=725.0, phase="generate",
                 doing="step 3 of stage rl: generating, 5/16 trajectories done")
    record_event(paths, "gave_up", role="rollout", host="gpu2", exit=-9, restarts=3, limit=3)
    texts = [f["text"] for f in faults(paths, now + 1)]
    assert texts[0] == "sandbox service on cpu1 restarted 2x in the last 10 min (last exit -9)"
    assert texts[1].startswith("role rollout hung in phase generate for 12 min, restarted (step 3 of stage rl")
    assert texts[2] == "role rollout failed 4x, more than launch.role_restarts=3: its job stopped"
    assert len(texts) == 3


def test_stale_counts_from_the_attempts_start_and_says_what_it_did(tmp_path):
    paths = RunPaths(tmp_path)
    t0 = time.time()
    assert stale(paths, "trainer", t0, 60, now=t0 + 59) is None
    hung = stale(paths, "trainer", t0, 60, now=t0 + 61)   # never beat since it started
    assert hung["phase"] == "start" and "no heartbeat since it started" in hung["doing"]
    write_heartbeat(paths, "trainer", "stage rl: training on the trajectories of step 4", phase="train")
    beat = json.loads(paths.heartbeat("trainer").read_text())["time"]
    assert stale(paths, "trainer", t0, 60, now=beat + 59) is None
    hung = stale(paths, "trainer", t0, 60, now=beat + 100)
    assert hung["phase"] == "train" and hung["silent_s"] == 100.0 and hung["doing"].startswith("stage rl")
    # a heartbeat of an earlier attempt says nothing of this one
    assert stale(paths, "trainer", beat + 1, 60, now=beat + 100)["phase"] == "start"
    assert stale(paths, "trainer", t0, 0, now=beat + 10_000) is None   # 0: never


def test_run_status_lists_faults_among_its_problems(tmp_path):
    from rstar_hpc.config import load_config
    from rstar_hpc.launch.status import run_status

    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}", "run.name=f"])
    paths = RunPaths(cfg.run.dir)
    record_event(paths, "hang", role="trainer", host="gpu1", silent_s=1900.0, phase="train", doing="stage rl: training")
    st = run_status(cfg, paths, with_slurm=False)
    assert [f["kind"] for f in st["faults"]] == ["hang"]
    assert "role trainer hung in phase train for 32 min, restarted (stage rl: training; host gpu1)" in st["problems"]


def test_a_requeued_jobs_supervisor_records_the_node_its_job_lost(tmp_path, monkeypatch):
    """The requeued job's start compares its allocation with the previous start's (RUN/launch/allocation.json): a node
    it left that Slurm holds DOWN is recorded once as node_lost, named by run status; a node merely not given again,
    or a first start, records nothing. Slurm's answers are stood in for (the real loss: test_launch_chaos.py)."""
    from rstar_hpc.launch import nodes

    states = {"cpu1": ("DOWN+NOT_RESPONDING", "Not responding"), "cpu2": ("MIXED", ""), "gpu1": ("MIXED", ""),
              "gpu2": ("IDLE", "")}
    monkeypatch.setattr(nodes, "hostnames", lambda nodelist: nodelist.split(","))
    monkeypatch.setattr(nodes, "node_states", lambda names: {n: states[n] for n in names})
    paths = RunPaths(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert nodes.note_requeue_after_node_loss(paths, {"trainer": "gpu2", "sandbox": "cpu1"}) == []   # no record yet
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    events = nodes.note_requeue_after_node_loss(paths, {"trainer": "gpu1", "sandbox": "cpu2"})
    assert [(e["kind"], e["role"], e["host"], e["state"], e["now_on"]) for e in events] == [
        ("node_lost", "sandbox", "cpu1", "DOWN+NOT_RESPONDING", "cpu2")]   # gpu2 was left, but it is up
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    assert nodes.note_requeue_after_node_loss(paths, {"trainer": "gpu1", "sandbox": "cpu2"}) == []
    assert [f["text"] for f in faults(paths)] == [
        "node cpu1 lost (DOWN+NOT_RESPONDING: Not responding): Slurm requeued the job (restart 2), the sandbox now "
        "on cpu2"]
    assert nodes.lost_nodes("cpu1,cpu2,gpu1") == {"cpu1": states["cpu1"]}


def test_node_states_reads_state_and_reason_from_scontrol(monkeypatch):
    from rstar_hpc.launch import nodes

    line = ("NodeName=cpu1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 State=DOWN+NOT_RESPONDING ThreadsPerCore=1 "
            "Partitions=cpu Reason=Not responding [root@2026-11-26T07:18:03] Comment=(null)\n")
    monkeypatch.setattr(nodes.subprocess, "run", lambda *a, **k: type("P", (), {"stdout": line})())
    assert nodes.node_states(["cpu1"]) == {"cpu1": ("DOWN+NOT_RESPONDING", "Not responding")}


def test_a_role_whose_node_is_lost_is_not_started_there_again(tmp_path, monkeypatch):
    """The supervisor sees a role's step end with one of its nodes lost in Slurm: no restart on the dead node (and no
    crash counted), a node_lost event naming the node, and the job stopped for a requeue onto the nodes left."""
    from rstar_hpc.config import load_config
    from rstar_hpc.launch import supervise

    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}", "run.name=lost"])
    paths = RunPaths(tmp_path / "lost")
    sup = supervise.Supervisor(cfg, paths, {"trainer": 0, "rollout": 1, "sandbox": 2})
    monkeypatch.setenv("SLURM_JOB_NODELIST_HET_GROUP_2", "cpu1")
    monkeypatch.setattr(supervise, "lost_nodes", lambda nodelist: {"cpu1": ("DOWN+NOT_RESPONDING", "Not responding")}
                        if nodelist == "cpu1" else {})
    monkeypatch.setattr(sup, "start", lambda role: pytest.fail(f"{role} started again on a lost node"))
    sup.restart("sandbox", -9)
    assert sup.stop_reason == "node cpu1 lost" and not sup.failed and sup.restarts["sandbox"] == 0
    assert [(e["kind"], e["role"], e["host"], e["requeued"]) for e in read_events(paths)] == [
        ("node_lost", "sandbox", "cpu1", False)]
    assert [f["text"] for f in faults(paths)] == ["node cpu1 lost (DOWN+NOT_RESPONDING: Not responding): the "
                                                  "sandbox's step ended; the job requeues onto the nodes left"]


def test_a_stop_during_the_restart_back_off_ends_it_and_starts_nothing(tmp_path, monkeypatch):
    """USR2 arrives while the supervisor waits to start a crashed trainer again: the running rollout is told to save
    (it gets the USR2), the back-off ends at once, and the trainer is not started (it would be killed before it
    could save)."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    from rstar_hpc.config import load_config
    from rstar_hpc.launch import supervise

    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}", "run.name=backoff"])
    paths = RunPaths(tmp_path / "backoff")
    paths.create()
    sup = supervise.Supervisor(cfg, paths, {"trainer": 0, "rollout": 1, "sandbox": 2})
    monkeypatch.setattr(supervise, "lost_nodes", lambda nodelist: {})
    monkeypatch.setattr(sup, "start", lambda role: pytest.fail(f"{role} started after the stop"))
    saved = tmp_path / "rollout-saved"
    rollout = subprocess.Popen([sys.executable, "-c", "import signal, sys, time, pathlib\n"
                                f"def save(*a): pathlib.Path({str(saved)!r}).write_text('saved'); sys.exit(0)\n"
                                "signal.signal(signal.SIGUSR2, save)\nprint('ready', flush=True)\ntime.sleep(60)"],
                               stdout=subprocess.PIPE, text=True)
    assert rollout.stdout.readline().strip() == "ready"
    sup.procs["rollout"] = rollout
    sup.restarts["trainer"] = 3   # the fourth restart waits 40 s
    before = signal.signal(signal.SIGUSR2, sup.on_signal)
    try:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGUSR2)).start()
        t0 = time.monotonic()
        sup.restart("trainer", 1)
        waited = time.monotonic() - t0
    finally:
        signal.signal(signal.SIGUSR2, before)
    assert rollout.wait(30) == 0 and saved.read_text() == "saved"
    assert sup.stop_reason == "the time limit is near (USR2)" and not sup.failed
    assert 0.9 < waited < 20, waited   # the back-off was 40 s: it ended at the signal
    assert [(e["kind"], e["role"]) for e in read_events(paths)] == [("crash", "trainer")]


def test_end_step_lets_a_role_run_without_srun_clean_up(tmp_path):
    """The graceful end of a healthy step (the sandbox's once the run is done): a role run without srun gets SIGTERM
    and its handler runs; one that ignores it is SIGKILLed after the grace time."""
    import subprocess
    import sys

    from rstar_hpc.launch.watch import end_step

    cleaned = tmp_path / "cleaned"
    polite = subprocess.Popen([sys.executable, "-c", "import signal, sys, time, pathlib\n"
                               f"def bye(*a): pathlib.Path({str(cleaned)!r}).write_text('ok'); sys.exit(0)\n"
                               "signal.signal(signal.SIGTERM, bye)\nprint('ready', flush=True)\ntime.sleep(60)"],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert polite.stdout.readline().strip() == "ready"
    end_step(polite, [sys.executable], grace_s=30)
    assert polite.returncode == 0 and cleaned.read_text() == "ok"
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n"
                                 "time.sleep(60)"], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert stubborn.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    end_step(stubborn, [sys.executable], grace_s=1)
    assert stubborn.returncode == -9 and time.monotonic() - t0 < 20


def test_a_submitit_role_whose_srun_hangs_has_its_named_step_cancelled(tmp_path, monkeypatch):
    """The submitit RoleJob's hang handling is the supervisor's: a role whose heartbeat goes stale while its srun
    hangs too (here an `srun` that stops itself) has srun's process group killed and its step, named rstar-<role>,
    cancelled through Slurm (watch.cancel_step, which the supervisor calls the same way), then counts as a restart."""
    import os
    import stat

    from rstar_hpc.config import dump_config, load_config
    from rstar_hpc.launch import watch
    from rstar_hpc.launch.submitit_launch import RoleJob

    cfg = load_config("tiny-cpu", [f"run.root={tmp_path}", "run.name=hung", "launch.role_restarts=0",
                                   "launch.trainer.tasks_per_node=2"])
    paths = RunPaths(tmp_path / "hung")
    paths.create()
    (paths.dir / "config.yaml").write_text(dump_config(cfg))
    bin_dir, seen = tmp_path / "bin", tmp_path / "srun-args"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(f'#!/bin/sh\necho "$@" > {seen}\nkill -STOP $$\n')
    srun.chmod(srun.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    cancelled = []
    monkeypatch.setattr(watch, "cancel_step", lambda name, wait_s=60.0: cancelled.append(name))
    job = RoleJob(str(paths.dir), "trainer")
    job.hang_timeout_s = 1.0
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="trainer hung 1 times, more than launch.role_restarts=0"):
        job()
    assert time.monotonic() - t0 < 30
    assert seen.read_text().split()[:2] == ["--job-name=rstar-trainer", "--overlap"]
    assert cancelled == ["rstar-trainer"]
    assert [(e["kind"], e["role"]) for e in read_events(paths)] == [("hang", "trainer"), ("gave_up", "trainer")]


def _row(offset: int, role: str, state: str, restarts: int, reason: str = "None") -> dict:
    return {"role": role, "job_id": f"700+{offset}", "state": state, "reason": reason, "restarts": restarts}


def test_a_hetjob_requeued_without_a_component_is_stranded():
    """The Slurm 22.05 signature (reproduced live in tests/integration/test_stranded_hetjob.py): +0 and +1 requeued
    and pending, +2 ended in the requeue with fewer restarts."""
    from rstar_hpc.launch.status import problems, stranded

    rows = [_row(0, "trainer", "PENDING", 1, "Resources"), _row(1, "rollout", "PENDING", 1, "Resources"),
            _row(2, "sandbox", "FAILED", 0, "JobLaunchFailure")]
    [s] = stranded(rows)
    assert s["job_id"] == "700" and [c["role"] for c in s["ended"]] == ["sandbox"]
    assert "job 700 can never start again" in s["text"] and "sandbox (700+2: FAILED, JobLaunchFailure)" in s["text"]
    said = problems({"stages": [], "jobs": rows, "roles": {}, "done": False, "cancelled": False})
    assert said[0] == s["text"]
    assert not any("is PENDING (Resources)" in line for line in said)   # the stranding says it; no third line


@pytest.mark.parametrize("rows", [
    [_row(0, "trainer", "PENDING", 1), _row(1, "rollout", "PENDING", 1), _row(2, "sandbox", "PENDING", 1)],
    [_row(0, "trainer", "PENDING", 1), _row(1, "rollout", "REQUEUED", 0), _row(2, "sandbox", "COMPLETING", 0)],
    [_row(0, "trainer", "COMPLETED", 1), _row(1, "rollout", "COMPLETED", 1), _row(2, "sandbox", "COMPLETED", 1)],
    [_row(0, "trainer", "RUNNING", 0), _row(1, "rollout", "RUNNING", 0), _row(2, "sandbox", "FAILED", 0)],
    [{"role": "trainer", "job_id": "701", "state": "PENDING", "reason": "Resources", "restarts": 2}],
], ids=["requeued whole", "a requeue in progress", "ended whole", "ending", "not a hetjob"])
def test_what_is_not_stranded(rows):
    from rstar_hpc.launch.status import stranded

    assert stranded(rows) == []


def test_a_stranded_job_cancelled_and_resubmitted_is_named(tmp_path):
    paths = RunPaths(tmp_path)
    record_event(paths, "job_stranded", role="launch", job="700", resubmitted="705", ended=["sandbox"],
                 pending=["trainer", "rollout"])
    [f] = faults(paths)
    assert f["text"] == ("job 700 was stranded by Slurm (its sandbox component ended in a requeue, after a node loss): "
                         "cancelled, and the run submitted again as job 705")
