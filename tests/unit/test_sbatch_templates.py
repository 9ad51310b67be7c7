"""Every sbatch template parses as bash, says how to use it, and asks Slurm for a partition and a time limit."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

SBATCH = Path(__file__).resolve().parents[2] / "sbatch"
TEMPLATES = sorted(p for p in SBATCH.glob("*.sbatch") if p.name != "run.sbatch")   # run.sbatch: rendered


def test_there_are_templates():
    assert {"generate", "run", "trainer", "rollout", "sandbox"} <= {p.stem for p in SBATCH.glob("*.sbatch")}


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_template_is_valid_bash_with_usage_partition_and_time(path):
    text = path.read_text()
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert text.startswith("#!/bin/bash")
    header = "\n".join(line for line in text.splitlines()[:15] if line.startswith("#"))
    assert re.search(rf"sbatch .*sbatch/{re.escape(path.name)}", header), f"{path.name}: the header should show how to submit it"
    directives = re.findall(r"^#SBATCH (.+)$", text, re.M)
    assert any("--partition" in d for d in directives) and any("--time" in d for d in directives)


@pytest.mark.parametrize("name", ["trainer", "rollout", "sandbox"])
def test_role_templates_save_and_requeue_before_the_time_limit(name):
    text = (SBATCH / f"{name}.sbatch").read_text()
    assert re.search(r"^#SBATCH --signal=B:USR2@\d+$", text, re.M) and "--requeue" in text
    assert "trap " in text and "scontrol requeue" in text


def test_the_run_script_renders_a_valid_hetjob_from_the_config(tmp_path):
    from rstar_hpc.config import load_config
    from rstar_hpc.launch.hetjob import render

    cfg = load_config("qwen3-14b", [f"run.root={tmp_path}", "launch.qos=high", "launch.setup=[source /env/bin/activate]"])
    text = render(cfg, tmp_path / "run")
    path = tmp_path / "run.sbatch"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    components = text.split("#SBATCH hetjob")
    assert len(components) == 3
    for part in components:
        assert "#SBATCH --partition=" in part and "#SBATCH --time=" in part and "#SBATCH --nodes=" in part
    assert "#SBATCH --qos=high" in components[0] and "#SBATCH --qos" not in components[1]
    assert "source /env/bin/activate" in text and "{{" not in text and "#RSTAR-HEADER" not in text


def test_train_submit_asks_for_the_trainers_gpus_and_memory_as_the_launcher_does(tmp_path):
    """`rstar-hpc train --submit` sizes sbatch/trainer.sbatch's job from the launcher's own rules (hetjob.role_options):
    the node's GPUs (--gpus-per-node, never one GPU per task: no NVLink between ranks in a GPU cgroup each), the whole
    node's memory for a GPU role unless launch.trainer.mem says otherwise; its srun step asks for what the launcher's
    trainer step does (placement.step_resources)."""
    from rstar_hpc.cli.train import STEP_OPTS_ENV, submit_options
    from rstar_hpc.config import load_config
    from rstar_hpc.launch import hetjob, placement

    cfg = load_config("qwen3-14b", [f"run.root={tmp_path}", "launch.account=proj", "launch.qos=high"])
    args, env = submit_options(cfg, "sft", env={"HOME": "/home/u"})
    assert args[:len(hetjob.role_options(cfg, "trainer"))] == hetjob.role_options(cfg, "trainer")
    for opt in ("--partition=gpu", "--nodes=4", "--ntasks-per-node=8", "--cpus-per-task=8", "--gpus-per-node=8",
                "--mem=0", "--time=24:00:00", "--signal=B:USR2@300", "--account=proj", "--qos=high",
                f"--output={tmp_path}/qwen3-14b-rstar2/logs/trainer-sft-%j.out"):
        assert opt in args, (opt, args)
    assert not any("gpus-per-task" in a for a in args), args
    assert env == {"HOME": "/home/u", STEP_OPTS_ENV: "--gpus-per-node=8 --mem=0"}
    assert env[STEP_OPTS_ENV].split() == [o for o in placement.step_argv(cfg, "trainer", tmp_path)
                                          if o.startswith(("--gpus", "--mem"))]
    sized = load_config("qwen3-14b", [f"run.root={tmp_path}", "launch.trainer.mem=200G"])
    args, env = submit_options(sized, "sft", env={})
    assert "--mem=200G" in args and "--mem=0" not in args and env[STEP_OPTS_ENV] == "--gpus-per-node=8 --mem=200G"
    no_gres = load_config("qwen3-14b", [f"run.root={tmp_path}", "launch.gpu_gres=false"])
    args, env = submit_options(no_gres, "sft", env={})   # no GRES: each rank takes its GPU from SLURM_LOCALID
    assert not any(a.startswith("--gpus") for a in args) and "--mem=0" in args and env[STEP_OPTS_ENV] == "--mem=0"
    cpu = load_config("tiny-cpu", [f"run.root={tmp_path}"])
    args, env = submit_options(cpu, "sft", env={})
    assert not any(a.startswith(("--gpus", "--mem")) for a in args) and env[STEP_OPTS_ENV] == ""


@pytest.mark.parametrize("env,step", [
    ({"RSTAR_TRAINER_STEP_OPTS": "--gpus-per-node=8 --mem=200G", "SLURM_GPUS_ON_NODE": "8"},
     ["--gpus-per-node=8", "--mem=200G"]),                                       # `train --submit`: the launcher's
    ({"SLURM_GPUS_ON_NODE": "4"}, ["--gpus-per-node=4", "--mem=0"]),            # by hand on GPU nodes
    ({"RSTAR_TRAINER_STEP_OPTS": ""}, []),                                       # CPU nodes
    ({}, []),
], ids=["submit", "by-hand-gpus", "submit-cpu", "by-hand-cpu"])
def test_the_trainer_scripts_step_sees_its_nodes_gpus_and_its_jobs_memory(tmp_path, env, step):
    """The srun line sbatch/trainer.sbatch runs (Slurm's commands stubbed): every rank sees its node's GPUs and the
    step asks for memory; never one GPU per task."""
    import os

    text = (SBATCH / "trainer.sbatch").read_text()
    assert "gpus-per-task" not in text
    bin_dir, seen = tmp_path / "bin", tmp_path / "srun-args"
    bin_dir.mkdir()
    for name, body in {"srun": f'printf "%s\\n" "$@" > {seen}', "scontrol": 'echo "NodeAddr=10.0.0.1"'}.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    base = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu1",
            "SLURM_CPUS_PER_TASK": "12", "RSTAR_PYTHON": "py"}
    proc = subprocess.run(["bash", str(SBATCH / "trainer.sbatch"), "cfg.yaml", "--stage", "sft"], env={**base, **env},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert seen.read_text().splitlines() == ["--kill-on-bad-exit=1", "--cpus-per-task=12", *step, "py", "-m",
                                             "rstar_hpc", "train", "cfg.yaml", "--stage", "sft"]
