"""The placement of a run's tasks (rstar_hpc/launch/placement.py) and each task's own GPU binding (binding.py): the
14B recipe's layout through `launch --dry-run --json`, layouts refused with exit 3, and the srun lines."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import pytest

from rstar_hpc.config import load_config
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.launch import placement
from rstar_hpc.launch.binding import task_devices, task_gpus

BASE = ["model.path=/lustre/models/Qwen3-14B-Base"]


def dry_run(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rstar_hpc", "launch", "qwen3-14b", f"run.root={tmp_path}", *BASE,
                           *overrides, "--dry-run", "--json"], capture_output=True, text=True, timeout=120)


def check_layout(info: dict, tp: int) -> None:
    tasks = info["placement"]
    cfg_ranks = {"trainer": 32, "rollout": 1 + 4 * 8 // tp, "sandbox": 4}
    for role, n in cfg_ranks.items():
        assert sorted(t["rank"] for t in tasks if t["role"] == role) == list(range(n)), role
    used = defaultdict(list)   # the GPUs computed on, per node of a role: no GPU twice
    for t in tasks:
        used[(t["role"], t["node"])] += t["devices"]
        if t["role"] == "trainer":   # sees its node's 8 GPUs (NVLink to its peers), computes on its local rank's
            assert t["gpus"] == list(range(8)) and t["devices"] == [t["rank"] % 8], t
        elif t["role"] == "rollout":   # sees and computes on its TP block
            assert len(t["gpus"]) == (0 if t["rank"] == 0 else tp) and t["devices"] == t["gpus"], t
        else:
            assert t["gpus"] == [] == t["devices"]
    for key, gpus in used.items():
        assert len(gpus) == len(set(gpus)) and all(0 <= g < 8 for g in gpus), (key, gpus)
    scheduler = next(t for t in tasks if t["role"] == "rollout" and t["rank"] == 0)
    assert scheduler["gpus"] == [] and scheduler["node"] == 0
    for role in ("trainer", "rollout"):
        assert "--cpus-per-task=" in info["steps"][role], info["steps"][role]
        assert "--mem=0" in info["steps"][role], info["steps"][role]   # an exclusive GPU step asks for its memory
    # no trainer rank in a GPU cgroup of its own: NCCL could not use P2P/NVLink between the ranks of a node
    assert "--gpus-per-task" not in info["steps"]["trainer"] and "--gpus-per-node=8" in info["steps"]["trainer"]
    assert "--mem" not in info["steps"]["sandbox"]
    assert info["script"].count("#SBATCH --mem=0") == 2   # the trainer's and the rollout's components
    assert f"--ntasks={1 + 32 // tp}" in info["steps"]["rollout"] and "--mpi=none" in info["steps"]["rollout"]
    assert "--kill-on-bad-exit=0" in info["steps"]["rollout"]   # one engine's death ends no other (keeper.py)
    assert "--ntasks-per-node=1" in info["steps"]["sandbox"]


@pytest.mark.parametrize("tp,overrides", [(4, []), (2, ["rollout.engine.tensor_parallel_size=2",
                                                         "launch.rollout.tasks_per_node=4"])])
def test_14b_dry_run_places_every_task_on_its_own_gpus(tmp_path, tp, overrides):
    proc = dry_run(tmp_path, *overrides)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.splitlines()[-1])
    check_layout(info, tp)
    assert f"--ntasks-per-node={1 + 8 // tp}" in info["script"]   # the rollout component: engines + rank 0
    assert not (tmp_path / "qwen3-14b-rstar2").exists()


def test_human_dry_run_ends_with_a_node_by_node_table(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rstar_hpc", "launch", "qwen3-14b", f"run.root={tmp_path}", *BASE,
                          "--dry-run"], capture_output=True, text=True, timeout=120).stdout
    table = out[out.index("# placement"):]
    assert "# rollout[0]  scheduler, ranks 1-2  -|0-3|4-7" in table, table
    assert "# trainer[3]  ranks 24-31" in table and "# sandbox[3]" in table
    assert "#   rollout: srun --het-group=1" in out   # the steps the supervisor will start, in the script


@pytest.mark.parametrize("overrides,says", [
    (["launch.rollout.tasks_per_node=3"], "3 engines per node (launch.rollout.tasks_per_node) x tensor_parallel_size 4 = 12 GPUs, but a node has 8"),
    (["launch.trainer.tasks_per_node=5"], "not a multiple of"),
    (["launch.trainer.tasks_per_node=9", "launch.trainer.num_nodes=2", "trainer.tensor_parallel_size=2",
      "trainer.pipeline_parallel_size=1"], "9 ranks per node (launch.trainer.tasks_per_node) but 8 GPUs"),
    (["launch.rollout.cores_per_node=64"], "3 tasks per node (its engines plus rank 0) x cpus_per_task 32 = 96 cores"),
    (["launch.mpi=none"], "launch.mpi=none starts every rollout rank from one task on one node"),
])
def test_a_layout_that_cannot_fit_is_refused_before_anything_is_submitted(tmp_path, overrides, says):
    proc = dry_run(tmp_path, *overrides)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert says in " ".join(proc.stderr.split()), proc.stderr
    assert "nothing was submitted" in proc.stderr or "invalid config" in proc.stderr   # the loader knows TP x PP


def test_srun_lines_follow_mpi_container_and_gres_settings(tmp_path):
    cfg = load_config("qwen3-14b", [f"run.root={tmp_path}", *BASE, "launch.mpi=pmi2",   # read as tasks
                                    "launch.container.image=/lustre/images/rstar.sqsh", "launch.container.mounts=[/scratch]"])
    line = placement.steps(cfg, tmp_path / "run")["rollout"]
    assert cfg.launch.mpi.start == "tasks" and "--mpi=none" in line and "--container-image=/lustre/images/rstar.sqsh" in line
    mounts = line.split("--container-mounts=")[1].split()[0].split(",")
    assert f"{tmp_path}:{tmp_path}" in mounts and mounts[-1] == "/scratch"
    cfg = load_config("qwen3-14b", [f"run.root={tmp_path}", *BASE, "launch.container.runtime=apptainer",
                                    "launch.container.image=/x/rstar.sif", "launch.gpu_gres=false",
                                    "launch.cpu_bind=null"])
    line = placement.steps(cfg, tmp_path / "run")["trainer"]
    assert "apptainer exec --nv --bind=" in line and f"--bind={tmp_path}:{tmp_path} " in line
    assert " /x/rstar.sif python3 -m rstar_hpc train " in line
    assert "--gpus" not in line and "--cpu-bind" not in line   # no GRES: each rank picks its GPU (binding.py)
    one = load_config("tiny-cpu", [f"run.root={tmp_path}", "launch.mpi=none"])
    line = placement.steps(one, tmp_path / "run")["rollout"]
    assert "--ntasks=1" in line and line.endswith("--engines 1") and "--mpi" not in line
    # one MPI world: the site's PMI plugin, and a dead rank ends the step (the world is broken: the role restarts)
    world = load_config("qwen3-14b", [f"run.root={tmp_path}", *BASE, "launch.mpi.start=world"])
    line = placement.steps(world, tmp_path / "run")["rollout"]
    assert "--mpi=pmix" in line and "--kill-on-bad-exit=1" in line and "--distribution=arbitrary" in line, line
    line = placement.steps(world.model_copy(update={"launch": world.launch.model_copy(update={
        "mpi": world.launch.mpi.model_copy(update={"plugin": "pmi2"})})}), tmp_path / "run")["rollout"]
    assert "--mpi=pmi2" in line


def test_each_role_runs_its_own_image_with_the_images_python_and_the_configs_paths_mounted(tmp_path):
    """One image per role (trainer on a TE base, rollout on vLLM's, a slim sandbox): each step runs its image's
    interpreter, never the host's, with the run root, the model and the data mounted at their own paths."""
    data, model, root = tmp_path / "data", tmp_path / "models" / "q", tmp_path / "data" / "runs"
    data.mkdir()
    (data / "sft.jsonl").write_text("")
    cfg = load_config("tiny-cpu", [f"run.root={root}", f"model.path={model}", f"stages.sft.data={data}/sft.jsonl",
                                   "launch.container.image=/img/trainer.sqsh",
                                   "launch.rollout.container={image: /img/rollout.sqsh, python: /opt/venv/bin/python}",
                                   "launch.sandbox.container={image: /img/sandbox.sif, runtime: apptainer}"])
    lines = placement.steps(cfg, root / "tiny-cpu")
    host = sys.executable
    assert all(host not in line for line in lines.values()), lines
    assert "--container-image=/img/trainer.sqsh" in lines["trainer"] and " python3 -m rstar_hpc train " in lines["trainer"]
    assert "--container-image=/img/rollout.sqsh" in lines["rollout"]
    assert " /opt/venv/bin/python -m rstar_hpc rollout " in lines["rollout"]
    assert "--container-image" not in lines["sandbox"]
    assert "apptainer exec --bind=" in lines["sandbox"] and "--nv" not in lines["sandbox"]   # no GPUs there
    assert " /img/sandbox.sif python3 -m rstar_hpc sandbox serve " in lines["sandbox"]
    # the data folder read-only, the run root inside it read-write over it, the model read-only
    mounts = lines["trainer"].split("--container-mounts=")[1].split()[0].split(",")
    assert mounts == [f"{data}:{data}:ro", f"{root}:{root}", f"{model}:{model}:ro"], mounts
    # a role can leave the shared image and run on the host's python
    bare = load_config("tiny-cpu", [f"run.root={root}", "launch.container.image=/img/all.sqsh",
                                    "launch.sandbox.container={image: null}"])
    lines = placement.steps(bare, root / "tiny-cpu")
    assert "--container-image=/img/all.sqsh" in lines["rollout"]
    assert "--container" not in lines["sandbox"] and f"{host} -m rstar_hpc sandbox serve" in lines["sandbox"]
    # submitit's one-task roles and a one-node rollout start their command from the job itself: in the image too
    from rstar_hpc.launch.submitit_launch import RoleJob

    argv, _ = RoleJob(str(root / "tiny-cpu"), "sandbox").argv(cfg, 0)
    assert argv[:2] == ["apptainer", "exec"] and "/img/sandbox.sif" in argv and host not in argv, argv
    argv, _ = RoleJob(str(root / "tiny-cpu"), "rollout").argv(cfg, 0)
    assert argv[:3] == ["srun", "--job-name=rstar-rollout", "--overlap"], argv   # named: a hung one is cancelled
    assert "--container-image=/img/rollout.sqsh" in argv, argv
    assert argv[-2:] == ["--engines", "1"] and "/opt/venv/bin/python" in argv and host not in argv
    # the dry run prints the same lines
    proc = subprocess.run([sys.executable, "-m", "rstar_hpc", "launch", "tiny-cpu", f"run.root={root}",
                           "launch.rollout.container.image=/img/rollout.sqsh", "--dry-run"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--container-image=/img/rollout.sqsh" in proc.stdout and "python3 -m rstar_hpc rollout" in proc.stdout


def test_submitit_role_steps_are_named_and_placed_as_the_supervisors(tmp_path, monkeypatch):
    """A submitit RoleJob starts a role's tasks with the supervisor's srun line, --overlap, under the step name the
    supervisor gives it (rstar-<role>), so that a hung step is found and cancelled through Slurm (watch.kill_step):
    the GPUs of the trainer's node for every rank, never one GPU per task, and the node's memory."""
    from rstar_hpc.launch import submitit_launch, supervise
    from rstar_hpc.launch.submitit_launch import RoleJob

    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)   # the rollout's hostfile: no Slurm asked here
    monkeypatch.setattr(submitit_launch, "hostnames", lambda nodes: ["gpu1"])
    monkeypatch.setattr(placement, "write_hostfile", lambda cfg, run_dir, nodes: tmp_path / "hosts")
    cfg = load_config("qwen3-14b", [f"run.root={tmp_path}", *BASE])
    run = str(tmp_path / "run")
    sup = supervise.Supervisor(cfg, RunPaths(run), placement.het_groups(cfg))
    for role in ("trainer", "rollout", "sandbox"):
        argv, _ = RoleJob(run, role).argv(cfg, 0)
        assert argv[:3] == ["srun", f"--job-name=rstar-{role}", "--overlap"], argv
        assert argv[3:] == [a for a in sup.step_argv(role) if not a.startswith(("--het-group=", "--job-name="))][1:]
    trainer, _ = RoleJob(run, "trainer").argv(cfg, 0)
    assert "--gpus-per-node=8" in trainer and "--mem=0" in trainer
    assert not any(a.startswith("--gpus-per-task") for a in trainer), trainer
    # a role run as its command alone (one task, no image) is no step of its own: nothing to name
    one = load_config("tiny-cpu", [f"run.root={tmp_path}"])
    argv, _ = RoleJob(str(tmp_path / "tiny-cpu"), "sandbox").argv(one, 0)
    assert argv[0] != "srun" and not any(a.startswith("--job-name") for a in argv), argv


def test_step_resources_are_the_gpus_and_memory_of_the_launchers_steps(tmp_path):
    """placement.step_resources (what `train --submit`'s step asks for) is what step_argv puts in a role's line."""
    cfg = load_config("qwen3-14b", [f"run.root={tmp_path}", *BASE, "launch.trainer.mem=200G"])
    assert placement.step_resources(cfg, "trainer") == ["--gpus-per-node=8", "--mem=200G"]
    line = placement.step_argv(cfg, "trainer", tmp_path / "run")
    assert all(o in line for o in placement.step_resources(cfg, "trainer"))
    assert placement.step_resources(cfg, "sandbox") == []
    no_gres = load_config("qwen3-14b", [f"run.root={tmp_path}", *BASE, "launch.gpu_gres=false"])
    assert placement.step_resources(no_gres, "trainer") == ["--mem=0"]   # each rank's GPU from SLURM_LOCALID
    assert placement.step_resources(load_config("tiny-cpu", [f"run.root={tmp_path}"]), "trainer") == []


def test_each_task_takes_its_block_of_the_gpus_slurm_gave_it():
    cfg = load_config("qwen3-14b", BASE)   # rollout: 2 TP-4 engines a node, rank 0 beside the first node's
    step = {"SLURM_NODEID": "0", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert task_gpus(cfg, "rollout", {**step, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}) == []
    assert task_gpus(cfg, "rollout", {**step, "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}) == ["0", "1", "2", "3"]
    assert task_gpus(cfg, "rollout", {**step, "SLURM_PROCID": "2", "SLURM_LOCALID": "2"}) == ["4", "5", "6", "7"]
    second = {"SLURM_NODEID": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "SLURM_PROCID": "4",
              "SLURM_LOCALID": "1"}
    assert task_gpus(cfg, "rollout", second) == ["4", "5", "6", "7"]
    # a site that allocated a subset of the node: the block comes from what Slurm gave, not from 0..7
    shared = {"SLURM_NODEID": "1", "CUDA_VISIBLE_DEVICES": "8,9,10,11,12,13,14,15", "SLURM_PROCID": "3",
              "SLURM_LOCALID": "0"}
    assert task_gpus(cfg, "rollout", shared) == ["8", "9", "10", "11"]
    # mpirun inside a Slurm task (launch.mpi=none): MPI's own ranks win over the task's inherited SLURM_*
    under_mpirun = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "OMPI_COMM_WORLD_RANK": "2",
                    "OMPI_COMM_WORLD_LOCAL_RANK": "2"}
    assert task_gpus(cfg, "rollout", under_mpirun) == ["4", "5", "6", "7"]
    # a rank started by its keeper (rollout/keeper.py): the keeper's numbers win
    under_keeper = {**under_mpirun, "RSTAR_ROLLOUT_RANK": "1", "RSTAR_ROLLOUT_LOCAL_RANK": "1"}
    assert task_gpus(cfg, "rollout", under_keeper) == ["0", "1", "2", "3"]
    # trainer: every rank keeps its node's GPUs visible and computes on its local rank's (GRES or not)
    assert task_gpus(cfg, "trainer", {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "SLURM_LOCALID": "5"}) is None
    assert task_gpus(cfg, "trainer", {"SLURM_LOCALID": "3"}) is None
    assert task_devices(cfg, "trainer", {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "SLURM_LOCALID": "5"}) == [5]
    assert task_devices(cfg, "trainer", {"SLURM_LOCALID": "3"}) == [3]
    assert task_devices(cfg, "rollout", {**step, "SLURM_PROCID": "2", "SLURM_LOCALID": "2",
                                         "CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == [4, 5, 6, 7]
    assert task_gpus(cfg, "sandbox", {"SLURM_LOCALID": "0"}) is None
    with pytest.raises(RuntimeError, match="needs 4 GPUs, but the step sees 2"):
        task_gpus(cfg, "rollout", {"SLURM_NODEID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
                                   "CUDA_VISIBLE_DEVICES": "0,1"})
