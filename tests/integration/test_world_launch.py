"""launch.mpi.start=world on Open MPI 5, launched: the MPI that cannot join separately started ranks runs the whole
recipe when the rollout's ranks are one MPI world (`srun --mpi=pmix`). On the cluster of hosts, rank 0 and engine 1
on one host, engine 2 on another: an sft stage and an rl stage, whose engine 2's vLLM engine core is SIGSTOPped as a
step's work reaches it. Rank 0 finds it hung by its token counter (rollout.scheduler.engine_stall_s); no keeper can
start it again alone, so rank 0 stops the role with the step's finished trajectories in its journal, and the
supervisor starts the role again whole (one `crash` event): the world's way back, as after an engine's death, which
ends the world's step (tests/rollout/test_world.py) and is restarted the same way. The run ends with every rl step
holding exactly the prompts its data order gives it, none twice, and no process left (the stopped core neither).
Without world, `launch` refuses this MPI at submit time (tests/unit/test_launch_mpi.py)."""
from __future__ import annotations

import os
import signal
import time

import pytest
import yaml

from tests.helpers.launching import (_tail, assert_steps_hold_their_prompts, ci_config, engine_core, rstar,
                                     run_processes, status, wait_rl_step)
from tests.helpers.mpis import needs_ompi5, ompi5_libmpi
from tests.helpers.procfs import alive, environ

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.vllm, needs_ompi5]
RL_STEPS = 3
STALL_S = 15.0   # rollout.scheduler.engine_stall_s here


def _engine_rank_pid(run, rank: int) -> int | None:
    """The process of rollout rank `rank` (a task of the world: its SLURM_PROCID)."""
    for line in run_processes(run):
        pid, _, args = line.partition(" ")
        env = environ(int(pid))
        if "rstar_hpc rollout" in args and env.get("SLURM_PROCID") == str(rank) and "SLURM_STEP_ID" in env:
            return int(pid)
    return None


@pytest.mark.timeout(900)
def test_open_mpi_5_runs_the_recipe_as_one_world_and_an_engine_hang_costs_a_role_restart(
        hosts_cluster, tiny_model_dir, tmp_path):

    from rstar_hpc.exchange.events import read_events
    from rstar_hpc.exchange.rundir import RunPaths

    path = ci_config(tmp_path, "world", tiny_model_dir)
    cfg = yaml.safe_load(path.read_text())
    cfg["stages"] = [{"name": "sft", "kind": "sft", "num_steps": 2, "prompts_per_step": 8, "lr": 2.0e-3,
                      "data": "demo"},
                     {"name": "rl", "kind": "rl", "num_steps": RL_STEPS, "prompts_per_step": 4,
                      "max_response_length": 128, "data": "demo"}]
    cfg["launch"]["rollout"].update(num_nodes=2, tasks_per_node=1)
    cfg["launch"]["mpi"] = {"start": "world"}
    cfg["rollout"]["scheduler"].update(heartbeat_s=0.5, engine_stall_s=STALL_S, engine_timeout_s=20)
    path.write_text(yaml.safe_dump(cfg))
    lib = ompi5_libmpi()
    env = {**hosts_cluster.env, "OMP_NUM_THREADS": "1", "MPI4PY_LIBMPI": str(lib), "OPAL_PREFIX": str(lib.parents[1])}
    rstar("launch", str(path), "--json", env=env)
    run = tmp_path / "runs" / "world"
    paths = RunPaths(run)

    step = wait_rl_step(run, "generating, 0/", range(RL_STEPS - 1), "generating")
    rank_pid = _engine_rank_pid(run, 2)
    assert rank_pid is not None, run_processes(run)
    core = engine_core(rank_pid)
    os.kill(core, signal.SIGSTOP)
    deadline = time.monotonic() + 600
    while not (st := status(run, env))["done"]:
        assert time.monotonic() < deadline, "the run did not finish\n" + _tail(run)
        time.sleep(2)
    crashes = [e for e in read_events(paths) if e["kind"] == "crash" and e["role"] == "rollout"]
    assert len(crashes) == 1, (step, read_events(paths))
    [hung] = [e for e in read_events(paths) if e["kind"] == "engine_hung"]
    assert hung["rank"] == 2 and "made no token" in hung["reason"], hung
    assert_steps_hold_their_prompts(run, "rl", RL_STEPS)
    logs = {p.name.split("-")[0]: p.read_text(errors="replace") for p in (run / "logs").iterdir()}
    assert "starting rollout: srun" in logs["run"] and "--mpi=pmix" in logs["run"]
    assert logs["rollout"].count("the rollout's 3 ranks are one MPI world (Open MPI v5.") == 2   # and its restart
    assert "one MPI world cannot start an engine again alone" in logs["rollout"]
    deadline = time.monotonic() + 60
    while run_processes(run) and time.monotonic() < deadline:
        time.sleep(1)
    assert not run_processes(run), run_processes(run)
    assert not alive(core), f"the stopped engine core {core} outlived its world"
    assert not st["problems"], st["problems"]
