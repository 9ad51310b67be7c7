"""Where every task of a run goes, and the srun line that puts it there. One plan serves the sbatch supervisor, the
submitit launcher, `rstar-hpc launch --dry-run` (the placement table and JSON) and `run status` (planned beside
observed). Nodes are numbered from 0 within their role's het component.

    trainer  tasks_per_node ranks per node, each seeing its node's GPUs   srun --gpus-per-node=G (each rank
             and computing on its local rank's                                    sets its device: binding.py)
    rollout  rank 0 (the scheduler): an extra task on node 0, no GPU     srun --distribution=arbitrary
             engine ranks 1..: tasks_per_node per node, each holding       --gpus-per-node=G (then each rank
             tensor_parallel_size GPUs, disjoint blocks                     takes its block: launch/binding.py)
    sandbox  one service per node with all of its cpus_per_task cores    srun --ntasks-per-node=1

Why no trainer rank gets a GPU of its own from Slurm (`--gpus-per-task=1`): where the site constrains devices, that
puts each rank in a device cgroup holding one GPU, and NCCL can then not use P2P/NVLink between the ranks of a node
(tensor-parallel all-reduces go through host memory). Megatron and NeMo launch the same way: every rank sees its
node's GPUs and computes on its local rank's.

Why rank 0 is not bound by Slurm itself: a step's --gpus-per-task gives every task the same GPUs, so a GPU-less
scheduler cannot share a step with TP-sized engines; a het component of its own would cost a node and an MPI world
spanning components (PMIx across components is what sites get wrong most). So the rollout step gets its nodes' GPUs
from Slurm (GRES) and a hostfile that puts rank 0 beside the first node's engines, and each rank takes its block of
what Slurm gave (binding.py). Where a site has no GRES (`launch.gpu_gres: false`) every role takes its GPUs from
SLURM_LOCALID the same way. Every task gets --cpus-per-task and --cpu-bind.
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
from pathlib import Path

from rstar_hpc.launch import container
from rstar_hpc.launch.roles import role_argv, roles_needed

ROLE_ORDER = ("trainer", "rollout", "sandbox")


class PlacementError(ValueError):
    """A layout that cannot fit; the message names the numbers and the keys to change."""


@dataclasses.dataclass(frozen=True)
class Task:
    role: str
    rank: int
    het_group: int
    node: int
    gpus: tuple[int, ...]      # the node's GPU ids the task sees (a trainer rank: all of its node's)
    cpus: int
    devices: tuple[int, ...] = ()   # the ones it computes on (a trainer rank: its local rank's; an engine: its block)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "gpus": list(self.gpus), "devices": list(self.devices)}


def het_groups(cfg) -> dict[str, int]:
    """role -> het group index, for the roles this run needs, in ROLE_ORDER."""
    need = roles_needed(cfg)
    return {r: i for i, r in enumerate(r for r in ROLE_ORDER if r in need)}


def engines_per_node(cfg) -> int:
    return cfg.launch.rollout.tasks_per_node


def num_engines(cfg) -> int:
    return cfg.launch.rollout.num_nodes * engines_per_node(cfg)


def role_mem(cfg, role: str) -> str | None:
    """The --mem a role's job and steps ask for: launch.<role>.mem, else the whole node ("0") for a GPU or exclusive
    role, else none (the partition's default)."""
    res = getattr(cfg.launch, role)
    if res.mem is not None:
        return res.mem
    return "0" if res.gpus_per_node or res.exclusive else None


def step_gpus(cfg, role: str) -> list[str]:
    """The GPUs a role's step asks Slurm for: its nodes' (`--gpus-per-node`; every task of the step sees them, and
    each takes its own: a trainer rank its local rank's, an engine its block), none without GRES (launch.gpu_gres:
    false) or GPUs. Never `--gpus-per-task`: see the module's docstring."""
    gpus = getattr(cfg.launch, role).gpus_per_node if cfg.launch.gpu_gres else 0
    return [f"--gpus-per-node={gpus}"] if gpus and role != "sandbox" else []


def step_mem(cfg, role: str) -> list[str]:
    """The memory a GPU role's step asks for, as its job did (role_mem): without it a step gets the site's default
    memory per CPU, often far below what a GPU node's ranks need."""
    mem = role_mem(cfg, role)
    return [f"--mem={mem}"] if getattr(cfg.launch, role).gpus_per_node and mem is not None else []


def step_resources(cfg, role: str) -> list[str]:
    """A role's step's GPU and memory options (step_gpus, step_mem): what step_argv asks for besides tasks and
    cores, for a step started elsewhere (sbatch/trainer.sbatch under `rstar-hpc train --submit`)."""
    return [*step_gpus(cfg, role), *step_mem(cfg, role)]


def rollout_tasks_per_node(cfg) -> int:
    """Tasks the rollout component allocates per node: its engines, plus room for rank 0 (on node 0; every node of a
    component gets the same count)."""
    return engines_per_node(cfg) + 1


def tasks_per_node(cfg, role: str) -> int:
    """Tasks a role's allocation holds per node: the rollout's engines and rank 0, one sandbox service, else
    launch.<role>.tasks_per_node."""
    return {"rollout": rollout_tasks_per_node(cfg), "sandbox": 1}.get(role, getattr(cfg.launch, role).tasks_per_node)


def plan(cfg) -> list[Task]:
    """One Task per process the run starts (no checks: see problems())."""
    groups, launch = het_groups(cfg), cfg.launch
    tasks: list[Task] = []
    if "trainer" in groups:
        res = launch.trainer
        node_gpus = tuple(range(res.gpus_per_node))
        for rank in range(res.num_nodes * res.tasks_per_node):
            local = rank % res.tasks_per_node
            tasks.append(Task("trainer", rank, groups["trainer"], rank // res.tasks_per_node, node_gpus,
                              res.cpus_per_task, (local,) if res.gpus_per_node else ()))
    if "rollout" in groups:
        res, tp, per = launch.rollout, cfg.rollout.engine.tensor_parallel_size, engines_per_node(cfg)
        tasks.append(Task("rollout", 0, groups["rollout"], 0, (), res.cpus_per_task))
        for e in range(num_engines(cfg)):
            block = e % per
            gpus = tuple(range(block * tp, (block + 1) * tp)) if res.gpus_per_node else ()
            tasks.append(Task("rollout", e + 1, groups["rollout"], e // per, gpus, res.cpus_per_task, gpus))
    if "sandbox" in groups:
        res = launch.sandbox
        for node in range(res.num_nodes):
            tasks.append(Task("sandbox", node, groups["sandbox"], node, (), res.cpus_per_task))
    return tasks


def problems(cfg, node_cores: dict[str, int] | None = None) -> list[str]:
    """Why this layout cannot fit, each naming the numbers and what to change. `node_cores`: the cores of a node of
    each partition, where known (sinfo); launch.<role>.cores_per_node wins over it."""
    from rstar_hpc.config.trainer import layout_problems

    launch, groups, out = cfg.launch, het_groups(cfg), []
    if "trainer" in groups:
        res = launch.trainer
        if res.gpus_per_node and res.tasks_per_node > res.gpus_per_node:
            out.append(f"trainer: {res.tasks_per_node} ranks per node (launch.trainer.tasks_per_node) but "
                       f"{res.gpus_per_node} GPUs per node (launch.trainer.gpus_per_node); the trainer runs one rank "
                       f"per GPU")
        out += layout_problems(cfg.trainer, res.num_nodes * res.tasks_per_node)
    if "rollout" in groups:
        res, tp = launch.rollout, cfg.rollout.engine.tensor_parallel_size
        if res.gpus_per_node and res.tasks_per_node * tp > res.gpus_per_node:
            fit = res.gpus_per_node // tp
            out.append(f"rollout: {res.tasks_per_node} engines per node (launch.rollout.tasks_per_node) x "
                       f"tensor_parallel_size {tp} = {res.tasks_per_node * tp} GPUs, but a node has "
                       f"{res.gpus_per_node} (launch.rollout.gpus_per_node); at most {fit} TP-{tp} engine"
                       f"{'s' if fit != 1 else ''} fit a node")
        if launch.mpi.start == "none" and res.num_nodes > 1:
            out.append(f"launch.mpi=none starts every rollout rank from one task on one node, but launch.rollout."
                       f"num_nodes={res.num_nodes}; use launch.mpi=tasks for a rollout across nodes")
    for role in groups:
        res = getattr(launch, role)
        per_node = tasks_per_node(cfg, role)
        cores = res.cores_per_node or (node_cores or {}).get(res.partition)
        if cores and per_node * res.cpus_per_task > cores:
            why = " (its engines plus rank 0)" if role == "rollout" else ""
            out.append(f"{role}: {per_node} tasks per node{why} x cpus_per_task {res.cpus_per_task} = "
                       f"{per_node * res.cpus_per_task} cores, but a node of partition {res.partition} has {cores}; "
                       f"lower launch.{role}.cpus_per_task or tasks_per_node")
    return out


def check(cfg, node_cores: dict[str, int] | None = None) -> None:
    found = problems(cfg, node_cores)
    if found:
        raise PlacementError("the layout cannot fit:\n  " + "\n  ".join(found))


def partition_cores(cfg, env=None) -> dict[str, int]:
    """The fewest cores of a node in each partition the run uses, from sinfo (empty when Slurm is not reachable)."""
    cores: dict[str, int] = {}
    for part in {getattr(cfg.launch, r).partition for r in het_groups(cfg)}:
        try:
            out = subprocess.run(["sinfo", "-h", "-p", part, "-o", "%c"], capture_output=True, text=True, env=env,
                                 timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            return {}
        counts = [int(x.rstrip("+")) for x in out.stdout.split() if x.rstrip("+").isdigit()]
        if out.returncode == 0 and counts:
            cores[part] = min(counts)
    return cores


def _span(ids: list[int]) -> str:
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1)) else ",".join(map(str, ids))


def table(tasks: list[Task]) -> str:
    """The placement, a line per node: its tasks, the GPUs each task computes on (| between tasks; - for none) and
    CPUs."""
    rows = [("node", "tasks", "GPUs per task", "CPUs")]
    for key in dict.fromkeys((t.role, t.node) for t in tasks):
        on = [t for t in tasks if (t.role, t.node) == key]
        ranks = [t.rank for t in on if not (t.role == "rollout" and t.rank == 0)]
        names = (["scheduler"] if len(ranks) < len(on) else []) + ([f"rank{'s' if len(ranks) > 1 else ''} "
                                                                   f"{_span(ranks)}"] if ranks else [])
        cpus = sorted({t.cpus for t in on})
        rows.append((f"{key[0]}[{key[1]}]", ", ".join(names), "|".join(_span(list(t.devices)) if t.devices else "-"
                                                                        for t in on),
                     f"{len(on)} x {cpus[0]}" if len(cpus) == 1 else "+".join(str(t.cpus) for t in on)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}" for r in rows)


# ------------------------------------------------------------------------------------------------------ job steps
def hostfile_lines(cfg, nodes: list[str]) -> list[str]:
    """SLURM_HOSTFILE of the rollout step: rank 0 and the first node's engines on node 0, then each node's engines."""
    per = engines_per_node(cfg)
    return [nodes[0]] + [nodes[e // per] for e in range(num_engines(cfg))]


def write_hostfile(cfg, run_dir: str | Path, nodes: list[str]) -> Path:
    """RUN/launch/rollout-<job>.hosts for the rollout step's SLURM_HOSTFILE (hostfile_lines)."""
    path = Path(run_dir) / "launch" / f"rollout-{os.environ.get('SLURM_JOB_ID', 'local')}.hosts"
    path.write_text("\n".join(hostfile_lines(cfg, nodes)) + "\n")
    return path


def step_argv(cfg, role: str, run_dir: str | Path, *, het_group: int | None = None, overlap: bool = False
              ) -> list[str]:
    """The srun line that starts ROLE's tasks in its allocation (a het group of the run's job, or a job of its own
    with `overlap`, as the submitit launcher runs it). The rollout's line expects SLURM_HOSTFILE (hostfile_lines)
    unless launch.mpi is none."""
    launch, res = cfg.launch, getattr(cfg.launch, role)
    srun = ["srun", *([f"--het-group={het_group}"] if het_group is not None else []), *(["--overlap"] if overlap else [])]
    # a trainer rank that dies takes its step down (the others would wait on it until a timeout); the supervisor
    # starts the role again. One sandbox service or one rollout engine dying leaves the others working (an engine's
    # keeper starts it again; rank 0's end ends the other tasks: rollout/keeper.py), but in one MPI world (mpi.start
    # world) a dead rank leaves the world broken: the step ends, as the trainer's does
    world = role == "rollout" and launch.mpi.start == "world"
    srun.append("--kill-on-bad-exit=" + ("1" if role == "trainer" or world else "0"))
    gpus = step_gpus(cfg, role)
    argv = role_argv(cfg, role, run_dir)
    # --ntasks always: inside another step (submitit's) srun would take that step's SLURM_NTASKS as its own
    if role == "trainer":
        srun += [f"--nodes={res.num_nodes}", f"--ntasks={res.num_nodes * res.tasks_per_node}",
                 f"--ntasks-per-node={res.tasks_per_node}", f"--cpus-per-task={res.cpus_per_task}"]
        srun += gpus   # every rank sees the node's GPUs: NVLink between them
    elif role == "rollout" and launch.mpi.start == "none":
        # one task holding the node's engines' cores and GPUs; the command (the ranks' keeper) starts every rank
        srun += ["--nodes=1", "--ntasks=1", f"--cpus-per-task={rollout_tasks_per_node(cfg) * res.cpus_per_task}"]
        srun += gpus
        argv = [*argv, "--engines", str(num_engines(cfg))]
    elif role == "rollout":
        # one task per rank, each its own MPI process (no PMI wire-up: rollout/links.py), or one world's ranks
        srun += [f"--mpi={launch.mpi.plugin if world else 'none'}", f"--nodes={res.num_nodes}",
                 f"--ntasks={1 + num_engines(cfg)}",
                 "--distribution=arbitrary", f"--cpus-per-task={res.cpus_per_task}"]
        srun += gpus
    else:
        srun += [f"--nodes={res.num_nodes}", f"--ntasks={res.num_nodes}", "--ntasks-per-node=1",
                 f"--cpus-per-task={res.cpus_per_task}"]
    if launch.cpu_bind and not (role == "rollout" and launch.mpi.start == "none"):
        srun.append(f"--cpu-bind={launch.cpu_bind}")
    srun += step_mem(cfg, role)   # a step asks for its memory, as its job did
    return [*srun, *container.srun_options(cfg, role), *container.command_prefix(cfg, role), *argv]


def steps(cfg, run_dir: str | Path) -> dict[str, str]:
    """role -> the srun line the run's supervisor starts it with (shown by `launch --dry-run`)."""
    groups = het_groups(cfg)
    one = len(groups) == 1   # a job of one component is no hetjob: srun refuses --het-group there
    return {role: shlex.join(step_argv(cfg, role, run_dir, het_group=None if one else g))
            for role, g in groups.items()}
