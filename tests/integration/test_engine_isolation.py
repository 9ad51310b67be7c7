"""One rollout engine's death costs only its own work: on the emulated cluster, a launched run with two engines
(launch.rollout.tasks_per_node=2) has one engine rank killed with SIGKILL mid-step. The other engine keeps its
process and goes on, the dead one's trajectories are requeued, its keeper starts it again, it joins the running job,
and the run finishes with every RL step holding exactly the prompts its data order gives it, none lost or twice.
`run status` names the death and the return."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections import Counter

import pytest
import yaml
from tests.helpers.launching import REPO, _tail, rstar, run_processes, status

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(shutil.which("ompi-server") is None or shutil.which("bwrap") is None,
                                 reason="needs Open MPI's ompi-server and bwrap")]

RL_STEPS = 4


def two_engine_config(tmp_path, model_dir) -> str:
    """tiny-cpu cut to one sft and one rl stage of RL_STEPS steps, with two engine ranks."""
    cfg = yaml.safe_load((REPO / "configs/tiny-cpu.yaml").read_text())
    cfg["run"] = {"name": "engines", "root": str(tmp_path / "runs"), "seed": 0}
    cfg["model"] = {"path": str(model_dir)}
    cfg["rollout"]["engine"]["kv_cache_memory_mb"] = 64
    cfg["rollout"]["scheduler"]["journal_every_s"] = 0.3   # a step of seconds journals parts: "mid-step" is seen
    cfg["stages"] = [{"name": "sft", "kind": "sft", "num_steps": 2, "prompts_per_step": 8, "lr": 2.0e-3,
                      "data": "demo"},
                     {"name": "rl", "kind": "rl", "num_steps": RL_STEPS, "prompts_per_step": 4,
                      "max_response_length": 128, "data": "demo"}]
    cfg["launch"]["rollout"].update(tasks_per_node=2, engine_restarts=2)
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _engine_pid(run, rank: int) -> int | None:
    try:
        return json.loads((run / "placement" / f"rollout-{rank}.json").read_text())["pid"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return None


def _mid_step(run, steps: range) -> int | None:
    """An rl step whose journal holds finished trajectories and whose commit is not written yet."""
    from rstar_hpc.exchange.rundir import RunPaths

    for step in steps:
        d = RunPaths(run).traj_step_dir("rl", step)
        if any(d.glob("rollout-part-*.commit.json")) and not (d / "rollout.commit.json").exists():
            return step
    return None


def _joined(run, rank: int) -> int:
    """How often rank 0 saw engine `rank` join (its log)."""
    logs = "".join(p.read_text(errors="replace") for p in (run / "logs").glob("rollout-*.log"))
    return logs.count(f"engine rank {rank} joined (pid")


def _expected_uids(run) -> dict[int, list[str]]:
    """The prompts (one per sample) each rl step draws in the run's data order, as an uninterrupted run has them."""
    from transformers import AutoTokenizer

    from rstar_hpc.config import load_config
    from rstar_hpc.exchange.rundir import RunPaths
    from rstar_hpc.rollout.tasks import stage_steps

    cfg = load_config(str(run / "config.yaml"))
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    steps = stage_steps(cfg, RunPaths(run), "rl", tok, steps=range(RL_STEPS))
    return {t.step: sorted(i.prompt_uid for i in t.items) for t in steps}


@pytest.mark.timeout(1200)
def test_a_killed_engine_costs_only_its_work_and_comes_back(slurm_cluster, tiny_model_dir, tmp_path):
    from rstar_hpc.exchange.columns import from_table
    from rstar_hpc.exchange.events import read_events
    from rstar_hpc.exchange.reader import StepReader
    from rstar_hpc.exchange.rundir import RunPaths

    env = {**slurm_cluster.env, "OMP_NUM_THREADS": "1"}
    rstar("launch", two_engine_config(tmp_path, tiny_model_dir), "--json", env=env)
    run = tmp_path / "runs" / "engines"
    deadline = time.monotonic() + 600
    while (step := _mid_step(run, range(RL_STEPS - 1))) is None:
        assert time.monotonic() < deadline, "no rl step was seen mid-step\n" + _tail(run)
        time.sleep(0.05)
    survivor, victim = _engine_pid(run, 1), _engine_pid(run, 2)
    os.kill(victim, signal.SIGKILL)
    # the trainer paused until the new engine has joined, so that a step is left for it: its start (a vLLM build,
    # a minute here) is much longer than what the tiny run has left
    trainer = json.loads((run / "heartbeat" / "trainer.json").read_text())["pid"]
    os.kill(trainer, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 300
        while _joined(run, 2) < 2:
            assert time.monotonic() < deadline, "engine rank 2 did not join again\n" + _tail(run)
            time.sleep(0.5)
    finally:
        os.kill(trainer, signal.SIGCONT)
    deadline = time.monotonic() + 900
    while not (st := status(run, env))["done"]:
        assert time.monotonic() < deadline, "the run did not finish\n" + _tail(run)
        assert not any(j["state"] in ("FAILED", "CANCELLED") for j in st["jobs"]), st["jobs"]
        time.sleep(2)

    # the survivor's process is the one from before the kill; the victim's keeper started a new one
    assert _engine_pid(run, 1) == survivor and _engine_pid(run, 2) not in (None, victim)
    events = read_events(RunPaths(run))
    lost = [e for e in events if e["kind"] == "engine_lost"]
    assert [(e["rank"], e["stage"], e["step"]) for e in lost] == [(2, "rl", step)], events
    assert "signal SIGKILL" in lost[0]["reason"]
    assert not [e for e in events if e["kind"] in ("crash", "hang", "gave_up")], events   # the role never restarted
    back = [e for e in events if e["kind"] == "engine_back"]
    assert [e["rank"] for e in back] == [2] and back[0]["step"] > step, events
    # `run status` says so
    texts = [f["text"] for f in status(run, env)["faults"]]
    assert any(t.startswith(f"rollout engine rank 2 lost in step {step} of stage rl") for t in texts), texts
    assert any(t.startswith("rollout engine rank 2 back") for t in texts), texts
    # every step: exactly its prompts, each trajectory once; the killed step ran without rank 2 after the kill
    expected, reader = _expected_uids(run), StepReader(RunPaths(run), "rl")
    for s in range(RL_STEPS):
        trajs = from_table(reader.read(s, ["rollout"]))
        assert sorted(t.prompt_uid for t in trajs) == expected[s], s
        assert len({t.key for t in trajs}) == len(trajs), s
    summaries = {r["step"]: r for r in map(json.loads, (run / "metrics" / "rollout.jsonl").read_text().splitlines())
                 if r.get("stage") == "rl"}
    assert summaries[step]["dead_engines"] == [2], summaries[step]
    ranks_after = Counter(t.engine_rank for s in range(back[0]["step"], RL_STEPS)
                          for t in from_table(reader.read(s, ["rollout"])))
    assert ranks_after[2] > 0, ranks_after   # back at work
    deadline = time.monotonic() + 60
    while run_processes(run) and time.monotonic() < deadline:
        time.sleep(1)
    assert not run_processes(run), run_processes(run)
