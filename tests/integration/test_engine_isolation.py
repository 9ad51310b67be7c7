"""One rollout engine's fault costs only its own work: on the emulated cluster of hosts (each node its own network,
hostname and /tmp), a launched run with two engines on two hosts (launch.rollout.num_nodes=2: rank 0 and engine 1
on one, engine 2 on the other, joined across the bridge) meets, in its one rl stage:
  0. engine rank 1's process SIGKILLed a few seconds into the stage, while the engines load the stage's first
     policy: rank 0 drops it at once (its keeper reports the death; no wait for the load's bound), the step begins
     with engine 2, and the keeper starts rank 1 again (its engine core went with the rank: parentage.py); it
     joins a later step;
  1. engine rank 2's vLLM engine core SIGSTOPped as a step's work reaches it (its rank goes on reporting): rank 0
     finds it hung by its token counter within rollout.scheduler.engine_stall_s (or, had it nothing in its engine
     yet, by the load bound), requeues its trajectories, and its keeper kills it whole (the stopped core included)
     and starts it again; it joins the running job; engine rank 1's process is untouched;
  2. engine rank 1's whole srun task SIGKILLed from the top a few seconds into a later step, while the engines load
     its policy (its keeper goes too, so no one restarts it): its rank and engine core die with the task within
     seconds; rank 0 finds it silent within engine_timeout_s and the run goes on with engine 2 alone (a task is
     not started again inside a job: the next job's start brings it back).
Each step met by a kill commits within 5 minutes of it (an uninterrupted step takes seconds, so the run is late by
less). The run finishes with every RL step holding exactly the prompts its data order gives it, none lost or twice,
and leaves no process (no stopped one either). `run status` names the hang, the losses and the returns. The model
is a tiny Qwen2 (QKV biases, tied embeddings): a family besides Qwen3 through SFT, RL and eval on the cluster."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from tests.helpers.launching import REPO, _tail, engine_core, rstar, run_processes, status, wait_rl_step
from tests.helpers.procfs import environ

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(shutil.which("ompi-server") is None or shutil.which("bwrap") is None,
                                 reason="needs Open MPI's ompi-server and bwrap")]

RL_STEPS = 6
LATE_S = 300.0   # the most a step met by a kill may end after it (the bound on the run's delay)
STALL_S = 15.0   # rollout.scheduler.engine_stall_s here
LOAD_S = 90.0    # policy_load_timeout_s: an engine whose core stops between steps hangs in its next load
GENERATING = "generating, 0/"                       # a step's work has just reached both engines
STARTING = r"starting 2 engine\(s\), 0 ready"       # rank 0 STARTed the engines, none ready yet: they load


@pytest.fixture(scope="module")
def qwen2_model_dir(tmp_path_factory):
    """A tiny random-init Qwen2 (QKV biases, tied embeddings: models/tiny.py): the run trains a family besides
    Qwen3 through SFT, RL and eval."""
    from rstar_hpc.config.run import TinyModelSpec
    from rstar_hpc.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("qwen2") / "tiny", TinyModelSpec(family="qwen2"))


def two_engine_config(tmp_path, model_dir) -> str:
    """tiny-cpu cut to one sft stage, one rl stage of RL_STEPS steps and an eval, with two engine ranks."""
    cfg = yaml.safe_load((REPO / "configs/tiny-cpu.yaml").read_text())
    cfg["run"] = {"name": "engines", "root": str(tmp_path / "runs"), "seed": 0}
    cfg["model"] = {"path": str(model_dir)}
    cfg["rollout"]["engine"]["kv_cache_memory_mb"] = 64
    cfg["rollout"]["scheduler"].update(journal_every_s=0.3,   # a step of seconds journals parts: a killed one keeps them
                                       heartbeat_s=0.5, engine_stall_s=STALL_S, policy_load_timeout_s=LOAD_S,
                                       engine_timeout_s=20)
    cfg["stages"] = [{"name": "sft", "kind": "sft", "num_steps": 2, "prompts_per_step": 8, "lr": 2.0e-3,
                      "data": "demo"},
                     {"name": "rl", "kind": "rl", "num_steps": RL_STEPS, "prompts_per_step": 4,
                      "max_response_length": 128, "data": "demo"},
                     {"name": "eval", "kind": "eval", "benchmarks": {"demo": "demo"}, "max_prompts": 4,
                      "num_samples": 2, "prompts_per_step": 4, "max_response_length": 128}]
    cfg["launch"]["rollout"].update(num_nodes=2, tasks_per_node=1, engine_restarts=2)
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _engine_pid(run, rank: int) -> int | None:
    try:
        return json.loads((run / "placement" / f"rollout-{rank}.json").read_text())["pid"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
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


def _task_top(pid: int) -> int:
    """The top process of the srun task `pid` runs in (slurmstepd's child): what a lost task's SIGKILL hits."""
    import psutil

    proc = psutil.Process(pid)
    while proc.parent() is not None and proc.parent().name() != "slurmstepd":
        proc = proc.parent()
    assert proc.parent() is not None, f"pid {pid} is not under a slurmstepd"
    return proc.pid


def _rank_processes(run, rank: int) -> list[int]:
    """Live processes of rollout rank `rank` of the run: the rank and what it started (they inherit its environment)."""
    out = []
    for proc in Path("/proc").iterdir():
        env = environ(int(proc.name)) if proc.name.isdigit() else {}
        if env.get("RSTAR_ROLLOUT_RANK") != str(rank) or not any(str(run) in v for v in env.values()):
            continue
        try:
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.append(int(proc.name))
        except OSError:   # gone meanwhile
            continue
    return out


def _committed_at(run, step: int) -> float:
    """When rl step `step`'s trajectories were committed (wall clock)."""
    from rstar_hpc.exchange.rundir import RunPaths

    return (RunPaths(run).traj_step_dir("rl", step) / "rollout.commit.json").stat().st_mtime


def _gone(pids: list[int], what: str, within_s: float = 15.0) -> None:
    import psutil

    deadline = time.monotonic() + within_s
    while left := [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]:
        assert time.monotonic() < deadline, f"{what} outlived it: {left}"
        time.sleep(0.2)


class _TrainerHeld:
    """The trainer SIGSTOPped until an engine has joined again, so that steps are left for it: its start (a vLLM
    build, a minute here) is much longer than what the tiny run has left."""

    def __init__(self, run):
        self.pid = json.loads((run / "heartbeat" / "trainer.json").read_text())["pid"]

    def __enter__(self):
        os.kill(self.pid, signal.SIGSTOP)

    def __exit__(self, *exc):
        os.kill(self.pid, signal.SIGCONT)


def _wait_joined(run, rank: int, times: int) -> None:
    deadline = time.monotonic() + 300
    while _joined(run, rank) < times:
        assert time.monotonic() < deadline, f"engine rank {rank} did not join again\n" + _tail(run)
        time.sleep(0.5)


@pytest.mark.timeout(1500)
def test_a_hung_or_killed_engine_costs_only_its_work_and_comes_back(hosts_cluster, qwen2_model_dir, tmp_path):
    import psutil

    from rstar_hpc.exchange.columns import from_table
    from rstar_hpc.exchange.events import read_events
    from rstar_hpc.exchange.reader import StepReader
    from rstar_hpc.exchange.rundir import RunPaths

    env = {**hosts_cluster.env, "OMP_NUM_THREADS": "1"}
    rstar("launch", two_engine_config(tmp_path, qwen2_model_dir), "--json", env=env)
    run = tmp_path / "runs" / "engines"
    events = lambda kind: [e for e in read_events(RunPaths(run)) if e["kind"] == kind]   # noqa: E731
    # 0. engine rank 1's process killed while the stage's first step loads its policy; its keeper starts it again
    load_step = wait_rl_step(run, STARTING, range(1), "starting its engines")
    first_rank1 = _engine_pid(run, 1)
    first_core1 = engine_core(first_rank1)
    os.kill(first_rank1, signal.SIGKILL)
    killed_at = time.time()
    _gone([first_rank1, first_core1], "engine rank 1's engine core")
    with _TrainerHeld(run):
        _wait_joined(run, 1, 2)
    # 1. engine rank 2's engine core stopped as a step's work reaches the engines, once rank 1 is back in the run
    while not events("engine_back"):
        time.sleep(0.2)
    hung_step = wait_rl_step(run, GENERATING, range(events("engine_back")[0]["step"], RL_STEPS - 3), "generating")
    survivor, hung_rank = _engine_pid(run, 1), _engine_pid(run, 2)
    core = engine_core(hung_rank)
    os.kill(core, signal.SIGSTOP)
    stopped_at = time.time()
    deadline = time.monotonic() + STALL_S + LOAD_S + 120
    # the trainer held from now: a core that stops between two steps hangs in the next load, and later steps go on
    # without it (late join) until the load's bound; while rank 0 waits for the next policy it judges that load too
    with _TrainerHeld(run):
        while not events("engine_hung"):
            assert time.monotonic() < deadline, "engine rank 2 was not found hung\n" + _tail(run)
            time.sleep(0.2)
        _wait_joined(run, 2, 2)
    assert _engine_pid(run, 1) == survivor and _engine_pid(run, 2) not in (None, hung_rank)
    assert not psutil.pid_exists(core) or psutil.Process(core).status() == psutil.STATUS_ZOMBIE, "the core lives on"
    # 2. engine rank 1's whole task killed while a step in which engine rank 2 is back loads its policy
    deadline = time.monotonic() + 300
    while not (back := [e for e in events("engine_back") if e["rank"] == 2]):
        assert time.monotonic() < deadline, "engine rank 2 did not take part again\n" + _tail(run)
        time.sleep(0.2)
    task_step = wait_rl_step(run, STARTING, range(back[0]["step"], RL_STEPS), "starting its engines")
    rank1 = _engine_pid(run, 1)
    core1 = engine_core(rank1)
    os.kill(_task_top(rank1), signal.SIGKILL)
    task_killed_at = time.time()
    _gone([rank1, core1], "engine rank 1's task")
    assert not _rank_processes(run, 1), _rank_processes(run, 1)   # the rank with its keeper, the core with the rank
    deadline = time.monotonic() + 900
    while not (st := status(run, env))["done"]:
        assert time.monotonic() < deadline, "the run did not finish\n" + _tail(run)
        assert not any(j["state"] in ("FAILED", "CANCELLED") for j in st["jobs"]), st["jobs"]
        time.sleep(2)

    # the trainer trained the Qwen2 and published it as one (its QKV biases converted both ways)
    _, policy = RunPaths(run).policies().latest()
    assert json.loads((policy / "config.json").read_text())["model_type"] == "qwen2"
    # each kill cost its step minutes at most: rank 0 did not wait out the load's bound
    assert _committed_at(run, load_step) - killed_at <= LATE_S
    assert _committed_at(run, task_step) - task_killed_at <= LATE_S
    seen = {r: json.loads((run / "placement" / f"rollout-{r}.json").read_text()) for r in (0, 2)}
    assert seen[0]["net_ns"] != seen[2]["net_ns"], seen   # engine 2 on a host of its own
    [hung] = events("engine_hung")
    assert (hung["rank"], hung["stage"]) == (2, "rl") and hung_step <= hung["step"] <= hung_step + 1, hung
    if hung["step"] == hung_step and "made no token" in hung["reason"]:   # it held requests: its token counter
        assert hung["time"] - stopped_at <= STALL_S + 10, hung
    else:   # it had nothing in its engine then: its next policy load never ended
        assert "still loading the policy" in hung["reason"] and hung["time"] - stopped_at <= LOAD_S + 30, hung
    lost = events("engine_lost")
    # (both struck while the heartbeat said "0 ready"; `starting` says whether the rank had said HELLO by then)
    assert [(e["rank"], e["stage"], e["step"]) for e in lost] == [(1, "rl", load_step), (1, "rl", task_step)], lost
    assert "SIGKILL" in lost[0]["reason"] or "ended" in lost[0]["reason"], lost[0]   # its keeper's word, at once
    assert lost[0]["time"] - killed_at <= 15, lost[0]
    # its keeper is gone: rank 0 finds it silent, or its connection broken
    assert any(w in lost[1]["reason"] for w in ("connection to rank 0 broke", "silent for")), lost[1]
    back1 = [e["step"] for e in events("engine_back") if e["rank"] == 1]
    assert len(back1) == 1 and load_step < back1[0] < task_step, events("engine_back")   # once: its task is gone
    assert not events("crash") + events("hang") + events("gave_up"), "the role restarted"
    # `run status` says so
    texts = [f["text"] for f in status(run, env)["faults"]]
    assert any(t.startswith(f"rollout engine rank 2 hung in step {hung['step']} of stage rl") for t in texts), texts
    for step in (load_step, task_step):
        assert any(t.startswith(f"rollout engine rank 1 lost in step {step} of stage rl") for t in texts), texts
    assert any(t.startswith("rollout engine rank 2 back") for t in texts), texts
    # every step: exactly its prompts, each trajectory once
    expected, reader = _expected_uids(run), StepReader(RunPaths(run), "rl")
    for s in range(RL_STEPS):
        trajs = from_table(reader.read(s, ["rollout"]))
        assert sorted(t.prompt_uid for t in trajs) == expected[s], s
        assert len({t.key for t in trajs}) == len(trajs), s
    summaries = {r["step"]: r for r in map(json.loads, (run / "metrics" / "rollout.jsonl").read_text().splitlines())
                 if r.get("stage") == "rl"}
    for step, rank in ((load_step, 1), (hung["step"], 2), (task_step, 1)):
        assert rank in summaries[step]["dead_engines"], (step, summaries[step])
    ranks_after = Counter(t.engine_rank for s in range(back[0]["step"], RL_STEPS)
                          for t in from_table(reader.read(s, ["rollout"])))
    assert ranks_after[2] > 0, ranks_after   # back at work
    deadline = time.monotonic() + 60
    while run_processes(run) and time.monotonic() < deadline:
        time.sleep(1)
    assert not run_processes(run), run_processes(run)
