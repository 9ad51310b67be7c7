"""The run's one heterogeneous Slurm job: `sbatch/run.sbatch`, its `#SBATCH` header rendered from the config.

Component 0 is the trainer's nodes, 1 the rollout's, 2 the sandbox's (a run without a trainer or rollout stage
drops the components it does not need). Job-wide options (name, log, requeue, the pre-timeout signal, account,
qos) go on the first component; resources on each. The script's body (sbatch/run.sbatch, after its header) runs
the supervisor, `python -m rstar_hpc.launch.supervise RUN`, which starts each role as a job step
(`srun --het-group=N`), restarts a role that dies, forwards Slurm's signals, and requeues the job when it was
stopped before the run was done.
"""
from __future__ import annotations

import shlex
from pathlib import Path

from rstar_hpc.launch import placement
from rstar_hpc.launch.placement import het_groups
from rstar_hpc.launch.roles import python_of
from rstar_hpc.assets import sbatch_template

HEADER_MARK = "#RSTAR-HEADER"   # the line of the template the rendered #SBATCH header replaces


def _hours(minutes: int) -> str:
    return f"{minutes // 60:d}:{minutes % 60:02d}:00"


def role_options(cfg, role: str) -> list[str]:
    """The sbatch resource options of one role's component."""
    res = getattr(cfg.launch, role)
    per_node = placement.tasks_per_node(cfg, role)
    opts = [f"--partition={res.partition}", f"--nodes={res.num_nodes}", f"--ntasks-per-node={per_node}",
            f"--cpus-per-task={res.cpus_per_task}", f"--time={_hours(res.time_min)}"]
    if res.gpus_per_node and cfg.launch.gpu_gres:
        opts.append(f"--gpus-per-node={res.gpus_per_node}")
    mem = placement.role_mem(cfg, role)
    if mem is not None:
        opts.append(f"--mem={mem}")
    for key in ("gres", "constraint"):
        if getattr(res, key):
            opts.append(f"--{key}={getattr(res, key)}")
    if res.exclusive:
        opts.append("--exclusive")
    return opts + list(res.extra)


def job_options(cfg, run_dir: str | Path) -> list[str]:
    """The job-wide options (on the first component)."""
    launch = cfg.launch
    opts = [f"--job-name=rstar-{cfg.run.name}", f"--output={Path(run_dir) / 'logs' / 'run-%j.out'}",
            "--open-mode=append", "--requeue", f"--signal=B:USR2@{launch.signal_lead_s}"]
    return opts + site_options(cfg)


def site_options(cfg) -> list[str]:
    """What every job of a run is charged to: launch.account and launch.qos."""
    launch = cfg.launch
    return ([f"--account={launch.account}"] if launch.account else []) + ([f"--qos={launch.qos}"] if launch.qos else [])


def header(cfg, run_dir: str | Path) -> str:
    lines = []
    for i, role in enumerate(het_groups(cfg)):
        if i:
            lines.append("#SBATCH hetjob")
        lines.append(f"# component {i}: {role}")
        opts = (job_options(cfg, run_dir) if i == 0 else []) + role_options(cfg, role)
        lines += [f"#SBATCH {o}" for o in opts]
    lines.append("# job steps the supervisor starts (placement: `rstar-hpc launch CONFIG --dry-run`):")
    lines += [f"#   {role}: {line}" for role, line in placement.steps(cfg, run_dir).items()]
    return "\n".join(lines)


def render(cfg, run_dir: str | Path) -> str:
    """The job script of a run: the template with its header rendered and the run's settings filled in."""
    template = sbatch_template("run")
    text = template.read_text()
    if HEADER_MARK not in text:
        raise ValueError(f"{template} lost its {HEADER_MARK} line; reinstall rstar-hpc")
    groups = het_groups(cfg)
    setup = "\n".join([*(f"module load {shlex.quote(m)}" for m in cfg.launch.modules), *cfg.launch.setup])
    values = {
        "RUN_DIR": shlex.quote(str(run_dir)), "PYTHON": shlex.quote(python_of(cfg)),
        "HET_GROUPS": shlex.quote(",".join(f"{r}={i}" for r, i in groups.items())),
        "SETUP": setup or ":",
    }
    text = text.replace(HEADER_MARK, header(cfg, run_dir))
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", value)
    return text
