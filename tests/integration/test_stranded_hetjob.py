"""A hetjob that Slurm strands after a node loss does not strand the run.

Slurm 22.05, on losing the node of a hetjob's component other than the last, requeues the components before it but
ends the last one, and the job then stays PENDING (Resources) for good (docs/reliability.md). Here, on a cluster of
its own (SlurmdTimeout=10, spare gpu nodes), two runs each have a real three-component `sbatch --requeue` hetjob of
`sleep`s standing in for their job (the run's launch record names it), and both jobs' +1 nodes are lost for good.
Then:
- `run status` says the job can never start again and what to do, without the bare "PENDING (Resources)" lines;
- for one run, `rstar-hpc launch` of its config (which refuses while a job of the run is active) cancels the
  stranded job and submits the run again; for the other, a follower (`launch --wait`'s) does so by itself once it
  has seen the job stranded for its grace time. A `job_stranded` event names both jobs, and `run status` says so.
The runs submitted again are cancelled at once: what they would do is every other launch test's."""
from __future__ import annotations

import json
import subprocess
import time

import pytest

from rstar_hpc.exchange.events import read_events
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.launch.launcher import LaunchError, follow
from rstar_hpc.launch.record import add_launch, current_jobs
from tests.helpers.launching import ci_config, rstar, status

pytestmark = [pytest.mark.slurm]

HETJOB = """#!/bin/bash
#SBATCH -p gpu -N1
#SBATCH hetjob
#SBATCH -p gpu -N1
#SBATCH hetjob
#SBATCH -p cpu -N1
srun --het-group=0 sleep 1000 & srun --het-group=1 sleep 1000 & srun --het-group=2 sleep 1000 & wait
"""


def _wait(what: str, pred, timeout_s: float = 180.0):
    t0 = deadline = time.monotonic()
    deadline += timeout_s
    while True:
        got = pred()
        if got:
            print(f"{what}: {time.monotonic() - t0:.1f} s")
            return got
        assert time.monotonic() < deadline, f"no {what} after {timeout_s:.0f} s"
        time.sleep(1.0)


def _components(env: dict, job: str) -> list[dict]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True,
                         timeout=30).stdout
    return [dict(t.partition("=")[::2] for t in line.split()) for line in out.splitlines()]


def _run_with_a_hetjob(tmp_path, name: str, model_dir, env: dict):
    """A run directory (its config.yaml, as a launch leaves it) whose launch record names a running hetjob of
    sleeps; (config path, run dir, job id, the +1 component's node)."""
    from rstar_hpc.config import load_config, prepare_run_dir

    config = ci_config(tmp_path, name, model_dir)
    run = prepare_run_dir(load_config(config)).dir
    script = tmp_path / f"{name}.sh"
    script.write_text(HETJOB)
    job = subprocess.run(["sbatch", "--parsable", "--requeue", "-o", str(tmp_path / f"{name}.out"), str(script)],
                         env=env, capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    add_launch(RunPaths(run), "sbatch", {"run": job})
    comps = _wait(f"{name}'s components running", lambda: (c := _components(env, job)) and len(c) == 3 and all(
        x["JobState"] == "RUNNING" for x in c) and c)
    return config, run, job, comps[1]["NodeList"]


def _stranding_said(run, env: dict, job: str) -> None:
    said = _wait(f"job {job} stranded in run status",
                 lambda: [p for p in status(run, env)["problems"] if "can never start again" in p])
    assert said[0].startswith(f"job {job} can never start again: Slurm requeued its trainer, rollout component(s) "
                              f"but ended its sandbox ({job}+2: ")
    assert "rstar-hpc launch" in said[0]
    assert not any("is PENDING" in p for p in status(run, env)["problems"])


def _resubmitted(run, env: dict, job: str) -> str:
    new = current_jobs(RunPaths(run))["run"]
    assert new != job
    assert {c["JobState"] for c in _components(env, job)} <= {"CANCELLED", "FAILED", "COMPLETED"}
    [event] = [e for e in read_events(RunPaths(run)) if e["kind"] == "job_stranded"]
    assert event["job"] == job and event["resubmitted"] == new and event["ended"] == ["sandbox"]
    assert any(f"job {job} was stranded by Slurm" in p and f"as job {new}" in p for p in status(run, env)["problems"])
    return new


@pytest.mark.timeout(600)
def test_a_stranded_hetjob_is_named_and_its_run_submitted_again(strand_cluster, tiny_model_dir, tmp_path):
    from rstar_hpc.config import load_config

    env = strand_cluster.env
    a_config, a_run, a_job, a_node = _run_with_a_hetjob(tmp_path, "by-launch", tiny_model_dir, env)
    b_config, b_run, b_job, b_node = _run_with_a_hetjob(tmp_path, "by-follow", tiny_model_dir, env)
    for node in (a_node, b_node):
        strand_cluster.lose_node(node)
    try:
        _stranding_said(a_run, env, a_job)
        # launch takes the stranded job's place (a job of the run that can still run would make it refuse)
        out = rstar("launch", str(a_config), "--json", env=env, timeout=300)
        assert f"job {a_job} can never start again: Slurm requeued" in out.stderr
        assert "cancelling it to submit the run again" in out.stderr
        assert _resubmitted(a_run, env, a_job) == json.loads(out.stdout.splitlines()[-1])["jobs"]["run"]
        # launch --wait's follower does it by itself, then follows the new job (until its timeout, here)
        _stranding_said(b_run, env, b_job)
        said: list[str] = []
        with pytest.raises(LaunchError, match="not done after"):
            follow(load_config(b_config), RunPaths(b_run), env, echo=said.append, timeout_s=12, poll_s=1,
                   stranded_grace_s=3)
        new = _resubmitted(b_run, env, b_job)
        assert any(f"submitted again as job {new}" in line for line in said), said
    finally:
        for run in (a_run, b_run):   # the lost nodes stay lost: the cluster is this test's alone
            rstar("run", "cancel", str(run), env=env, check=False)
