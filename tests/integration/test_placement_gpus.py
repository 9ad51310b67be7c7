"""Placement on a GPU partition, on the emulated cluster with fake GPUs (GRES) and CPU binding (task/affinity):
a launched run's every task records what Slurm and its own binding gave it, and `run status --json` lists that
beside the plan. Trainer ranks see both GPUs of their node (NCCL's P2P/NVLink between them) and each computes on its
local rank's, the rollout's scheduler has none and its engine its own, no GPU is computed on twice on a node, and
every task is pinned to the cores it asked for."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import defaultdict

import pytest
import yaml
from tests.helpers.launching import REPO, _tail, rstar, status

pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(shutil.which("ompi-server") is None or shutil.which("bwrap") is None,
                                 reason="needs Open MPI (ompi-server) and bwrap")]


def small_config(tmp_path, model_dir) -> str:
    """tiny-cpu cut to one sft and one rl stage, with two trainer ranks on a node of two GPUs."""
    cfg = yaml.safe_load((REPO / "configs/tiny-cpu.yaml").read_text())
    cfg["run"] = {"name": "gpus", "root": str(tmp_path / "runs"), "seed": 0}
    cfg["model"] = {"path": str(model_dir)}
    cfg["rollout"]["engine"]["kv_cache_memory_mb"] = 64
    cfg["stages"] = [{"name": "sft", "kind": "sft", "num_steps": 2, "prompts_per_step": 8, "lr": 2.0e-3,
                      "data": "demo"},
                     {"name": "rl", "kind": "rl", "num_steps": 1, "prompts_per_step": 2, "max_response_length": 128,
                      "data": "demo"}]
    cfg["launch"]["trainer"].update(gpus_per_node=2, tasks_per_node=2)
    cfg["launch"]["rollout"].update(gpus_per_node=2)
    path = tmp_path / "gpus.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_doctor_inside_a_step_prints_what_the_task_got(gpu_cluster):
    out = subprocess.run(["srun", "-p", "gpu", "--ntasks=2", "--gpus-per-task=1", "--cpus-per-task=1",
                          "--cpu-bind=cores", "--label", sys.executable, "-m", "rstar_hpc", "doctor", "--json",
                          *(a for c in ("vllm", "mpi", "bwrap", "gpus", "slurm") for a in ("--skip", c))], capture_output=True, text=True, env=gpu_cluster.env, timeout=180)
    seen = {}
    for task in ("0", "1"):
        lines = "".join(line.split(": ", 1)[1] + "\n" for line in out.stdout.splitlines()
                        if line.split(":", 1)[0].strip() == task)
        check = {c["name"]: c for c in json.loads(lines)}["placement"]
        assert check["status"] == "ok" and "step 0" in check["detail"], check
        seen[task] = check["detail"]
    assert "CUDA_VISIBLE_DEVICES=0," in seen["0"] and "CUDA_VISIBLE_DEVICES=1," in seen["1"], seen
    assert all("1 CPUs in its affinity" in d for d in seen.values()), seen


@pytest.mark.slow
@pytest.mark.vllm
def test_every_task_runs_on_its_own_gpus_and_cores(gpu_cluster, tiny_model_dir, tmp_path):
    env = {**gpu_cluster.env, "OMP_NUM_THREADS": "1"}
    proc = rstar("launch", small_config(tmp_path, tiny_model_dir), "--wait", "--timeout-s", "900", env=env,
                 timeout=1000, check=False)
    run = tmp_path / "runs" / "gpus"
    assert proc.returncode == 0, proc.stderr[-3000:] + "\n" + _tail(run)
    st = status(run, env)
    assert st["done"], st["problems"]
    tasks = st["placement"]
    assert [(t["role"], t["rank"]) for t in tasks] == [("trainer", 0), ("trainer", 1), ("rollout", 0),
                                                       ("rollout", 1), ("sandbox", 0)]
    for t in tasks:
        seen = t["observed"]
        assert seen is not None, f"{t['role']} rank {t['rank']} recorded no placement"
        assert seen["gpus"] == seen["visible"] == t["gpus"], t   # Slurm's ids are 0,1 on each node: plan == observed
        assert seen["devices"] == t["devices"], t
        assert seen["cpus"] == t["cpus"] == 1, t     # --cpus-per-task=1 --cpu-bind=cores, not the whole host
    by_node = defaultdict(list)
    for t in tasks:
        by_node[(t["role"], t["observed"]["node"])] += t["observed"]["devices"]
    assert all(len(g) == len(set(g)) for g in by_node.values()), by_node
    trainer = [t["observed"] for t in tasks if t["role"] == "trainer"]
    assert [o["visible"] for o in trainer] == [[0, 1], [0, 1]] and trainer[0]["node"] == trainer[1]["node"]
    assert [o["device"] for o in trainer] == [0, 1]   # each from its local rank: distinct
    scheduler, engine = (t["observed"] for t in tasks if t["role"] == "rollout")
    assert scheduler["cuda_visible_devices"] == "" and engine["cuda_visible_devices"] == "0"
    assert scheduler["node"] == engine["node"] != trainer[0]["node"]
    sandbox = next(t["observed"] for t in tasks if t["role"] == "sandbox")
    assert sandbox["cuda_visible_devices"] is None and sandbox["node"].startswith("cpu")
