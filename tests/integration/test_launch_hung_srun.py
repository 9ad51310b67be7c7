"""A role whose `srun` client hangs together with its tasks (all SIGSTOPped: a stuck client, a frozen node's
processes) is restarted in the same job: the supervisor finds it silent past launch.hang_timeout_s, gets no answer
from srun to its two SIGINTs, kills srun's process group and cancels the step through Slurm (`scancel JOB.STEP`),
which still held the step's resources, so the restarted srun does not stay pending behind it. The run then ends
with every rl step committed once, with the prompts its step number draws, and no process of the run left."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from tests.helpers.launching import _tail, ci_config, leftover_processes, rstar, run_facts, run_processes, status
from tests.helpers.procfs import environ

from rstar_hpc.launch.status import ACTIVE

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.vllm]
STEPS, PROMPTS = 3, 4


def _rollout_step(run: Path) -> tuple[list[int], list[int]]:
    """The rollout's srun client (srun and the child it forks) and every process of its step (its tasks and their
    children), found by the step they run in (rank 0's SLURM_JOB_ID and SLURM_STEP_ID)."""
    beat = json.loads((run / "heartbeat" / "rollout.json").read_text())
    key = [environ(beat["pid"]).get(k) for k in ("SLURM_JOB_ID", "SLURM_STEP_ID")]
    assert all(key), f"rank 0 ({beat['pid']}) runs in no Slurm step: {key}"
    srun, tasks = [], []
    for line in run_processes(run):
        pid, args = int(line.split()[0]), line.split(maxsplit=1)[1]
        if args.startswith("srun ") and "--job-name=rstar-rollout" in args:
            srun.append(pid)
        elif [environ(pid).get(k) for k in ("SLURM_JOB_ID", "SLURM_STEP_ID")] == key:
            tasks.append(pid)
    assert srun and beat["pid"] in tasks, (srun, tasks, run_processes(run))
    return srun, tasks


def _wait(what: str, pred, run: Path, timeout_s: float, poll_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out ({timeout_s:.0f} s) waiting for {what}\n{_tail(run)}"
        time.sleep(poll_s)


def _in_step(run: Path, step: int) -> bool:
    """The rollout at work on rl step `step` (waiting for its policy, loading it or generating), not done with it."""
    try:
        beat = json.loads((run / "heartbeat" / "rollout.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return f"step {step} of stage rl" in beat.get("doing", "") and "committed" not in beat["doing"]


@pytest.mark.timeout(1200)
def test_a_rollout_whose_srun_hangs_with_its_tasks_is_restarted_in_the_same_job(slurm_cluster, tiny_model_dir,
                                                                                 tmp_path):
    from rstar_hpc import pipeline
    from rstar_hpc.config import load_config
    from rstar_hpc.exchange.events import read_events
    from rstar_hpc.exchange.rundir import RunPaths

    env = {**slurm_cluster.env, "OMP_NUM_THREADS": "1"}
    # the shortest the config allows (rank 0 beats while its engines start, however long vLLM takes)
    config = ci_config(tmp_path, "hung-srun", tiny_model_dir, hang_timeout_s=60)
    cfg = yaml.safe_load(config.read_text())
    cfg["stages"] = [{"name": "rl", "kind": "rl", "num_steps": STEPS, "prompts_per_step": PROMPTS,
                      "max_response_length": 256, "data": "demo"}]
    cfg["trainer"]["heartbeat_s"] = 10
    cfg["trainer"]["collective_timeout_s"] = 30   # under hang_timeout_s (checked); one trainer rank: never waits
    config.write_text(yaml.safe_dump(cfg))
    t0 = time.monotonic()
    info = json.loads(rstar("launch", str(config), "--json", env=env).stdout.splitlines()[-1])
    run, job = tmp_path / "runs" / "hung-srun", info["jobs"]["run"]
    stopped: list[int] = []
    try:
        _wait("the rollout at work on step 1", lambda: _in_step(run, 1), run, 600, poll_s=0.05)
        srun, tasks = _rollout_step(run)
        for pid in [*srun, *tasks]:   # the client first: it must not see its tasks stop
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        t_stop = time.monotonic()
        _wait("the run done and its job over", lambda: (st := status(run, env))["done"] and not any(
            j["state"] in ACTIVE for j in st["jobs"]), run, 900, poll_s=2)
    finally:
        for pid in stopped:   # a failed test's leftovers: let them die
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    wall, after_stop = time.monotonic() - t0, time.monotonic() - t_stop
    st = status(run, env)
    assert st["done"] and {j["state"] for j in st["jobs"]} == {"COMPLETED"}, st["jobs"]
    restarts = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, env=env,
                              timeout=30).stdout
    assert "Restarts=0" in restarts, restarts   # restarted in the same job, not requeued
    (hang,) = [e for e in read_events(RunPaths(run)) if e["kind"] == "hang"]
    assert hang["role"] == "rollout" and hang["silent_s"] >= 60 and "step 1 of stage rl" in hang["doing"], hang
    assert not [e for e in read_events(RunPaths(run)) if e["kind"] in ("crash", "gave_up")], read_events(RunPaths(run))
    log = "".join(p.read_text() for p in (run / "logs").glob("run-*.out"))
    assert "srun of the step did not end" in log and "(rstar-rollout) is still in Slurm" in log, log[-3000:]
    assert "(rstar-rollout) is gone from Slurm after" in log, log[-3000:]
    assert log.count("starting rollout:") == 2, log[-3000:]
    # every step committed once, with the prompts its number draws, and trained once
    loaded = load_config(str(run / "config.yaml"))
    rows = pipeline.stage_prompts(loaded, loaded.stage("rl"))
    facts = run_facts(run)
    for step in range(STEPS):
        assert facts["commits"][("rl", step)] == ["rollout"], facts["commits"]
        want = [rows[(step * PROMPTS + i) % len(rows)]["uid"] for i in range(PROMPTS)]
        assert Counter(facts["uids"][("rl", step)]) == {u: loaded.algo.samples_per_prompt for u in want}, step
    assert facts["trainer"]["rl"][0] == STEPS and facts["trainer"]["rl"][2].get("trainer") == STEPS, facts["trainer"]
    deadline = time.monotonic() + 30
    while leftover_processes(run) and time.monotonic() < deadline:
        time.sleep(1)
    assert not leftover_processes(run), leftover_processes(run)
    print(json.dumps({"hung_srun_wall_s": round(wall, 1), "after_stop_s": round(after_stop, 1)}))
