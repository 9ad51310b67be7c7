"""The launchers' fault record (RUN/launch/events.jsonl) as `run status` names it, and the hang check's reading of a
heartbeat. The processes behind them (a SIGSTOPped role, a killed sandbox service) are in
tests/integration/test_hang_restart.py and tests/sandbox/test_network.py."""
from __future__ import annotations

import json
import multiprocessing
import time

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
