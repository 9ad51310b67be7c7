"""Where each role runs (Slurm resources per role) and the site settings every job of a run gets. `rstar-hpc launch`
renders them into the run's job script (`--dry-run` prints it): nothing is edited in a template."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from rstar_hpc.config.base import Section


class ContainerConfig(Section):
    """A container image the role's job steps run in (rstar_hpc/launch/container.py; images: containers/). The image
    holds rstar-hpc installed from its wheel; the step runs the image's `python -m rstar_hpc`, not the host's."""

    image: str | None = None
    """pyxis/enroot: an image or squashfs (--container-image); apptainer: a .sif path. Null: no container."""
    runtime: Literal["pyxis", "apptainer"] = "pyxis"
    """pyxis: srun's --container-image/--container-mounts (Slurm with the pyxis plugin); apptainer: each step's
    command runs under `apptainer exec [--nv] --bind ...`."""
    python: str = "python3"
    """The image's interpreter, the one rstar-hpc is installed into (a name on the image's PATH, or a path)."""
    mounts: list[str] = Field(default_factory=list)
    """More host paths to mount (SRC[:DST[:FLAGS]]). Always mounted at the same path: the run root (read-write), the
    model directory and the folder of every data file the config names (read-only)."""


class MPIConfig(Section):
    start: Literal["tasks", "none", "world", "pmix", "pmi2"] = "tasks"
    """How the rollout's ranks are started. tasks and none: every rank is an MPI process of its own, joined to rank 0
    through Open MPI 4's ompi-server (rollout/links.py), so an engine fails alone; `launch` refuses Open MPI 5 and
    MPICH there, whose separately started ranks cannot join (docs/reliability.md, "Which MPI"). tasks: one srun task
    per rank (`srun --mpi=none`), across nodes; none: one task on the first rollout node starts every rank itself (one
    rollout node). world: every rank a task of one MPI world (`srun --mpi=<plugin>`, the site's PMI), on any MPI
    that srun can start, Open MPI 5 and MPICH included; no engine fails alone there: an engine's death ends the
    rollout's step, and a hung one makes rank 0 stop the role, and the supervisor starts the role again
    (launch.role_restarts; the journal keeps the step's finished trajectories). pmix and pmi2 are read as tasks
    (they named the srun MPI plugin of the one world the ranks shared before engines were isolated)."""
    plugin: Literal["pmix", "pmi2"] = "pmix"
    """The srun MPI plugin (`srun --mpi=`) of start=world: pmix for Open MPI 4 and 5 (`srun --mpi=list` shows what the
    site's Slurm has), pmi2 for MPICH (pmix only where it was built with PMIx) and Intel MPI. `rstar-hpc launch`
    refuses a pair known not to start (Open MPI 5 with pmi2, MPICH without PMIx with pmix), and a rank whose MPI
    did not find srun's PMI stops at once, saying so."""
    interfaces: list[str] = Field(default_factory=list)
    """The network interfaces the rollout's ranks (and the name server they join through) talk over: names (ib0,
    eth0) or subnets (10.10.0.0/16), given to Open MPI's TCP transport and its wire-up (btl_tcp_if_include,
    oob_tcp_if_include). Empty: the interface that holds the node's Slurm address (its NodeAddr), so a node with
    several networks (ib0, eth0, docker0, a VPN) never publishes an address the other nodes cannot reach; Open MPI's
    own choice where that is a loopback address (one host) or cannot be found. The interfaces must exist, with those
    names, on every rollout node."""

    @field_validator("start")
    @classmethod
    def _start(cls, v: str) -> str:
        return "tasks" if v in ("pmix", "pmi2") else v


class RoleResources(Section):
    partition: str = "gpu"
    num_nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    cpus_per_task: int = Field(1, ge=1)
    tasks_per_node: int = Field(1, ge=1)
    """Tasks per node: the trainer one per GPU; the rollout one per vLLM engine (each holds
    rollout.engine.tensor_parallel_size GPUs; rank 0, the scheduler, is an extra GPU-less task on the first node);
    the sandbox one service per node, whatever this says. `rstar-hpc launch --dry-run` prints the placement."""
    time_min: int = Field(60, ge=1)
    """Slurm time limit; jobs checkpoint on the pre-timeout signal and are requeued."""
    mem: str | None = None
    """Slurm --mem of each node ("0": the whole node, "200G"), asked by the job and by the role's steps. Null: the
    whole node ("0") for a GPU or exclusive role (an exclusive job otherwise gets only the site's default memory per
    CPU, often far below a GPU node's), the partition's default for the others."""
    cores_per_node: int | None = Field(None, ge=1)
    """The node's cores, where you know them: `launch` then refuses a layout that asks for more (tasks x
    cpus_per_task). Null: checked against `sinfo` when Slurm is reachable."""
    gres: str | None = None
    """Slurm --gres (e.g. "gpu:8"), where a site asks for it instead of --gpus-per-node."""
    constraint: str | None = None
    """Slurm --constraint (node features, e.g. "a100&ib")."""
    exclusive: bool = False
    """Whole nodes (--exclusive)."""
    extra: list[str] = Field(default_factory=list)
    """More sbatch options for this role, verbatim (e.g. ["--reservation=rl"])."""
    container: ContainerConfig | None = None
    """This role's own image, in place of launch.container (null: launch.container's); `{image: null}`: the role
    runs on the host though the others run in launch.container."""


class RolloutResources(RoleResources):
    engine_restarts: int = Field(3, ge=0)
    """How often one engine rank's process is started again after it dies (rollout/keeper.py), over the job. An
    engine that dies more often is given up on: the job goes on with the engines left. The count starts again with
    each start of the rollout role."""


class LaunchConfig(Section):
    launcher: Literal["sbatch", "submitit"] = "sbatch"
    """sbatch: one heterogeneous job (trainer / rollout / sandbox groups) runs every stage; submitit: one job per
    role (submitit cannot express a heterogeneous job), meeting in the run directory. `rstar-hpc launch
    --launcher` overrides it."""
    trainer: RoleResources = RoleResources(partition="gpu")
    rollout: RolloutResources = RolloutResources(partition="gpu")
    sandbox: RoleResources = RoleResources(partition="cpu")
    mpi: MPIConfig = MPIConfig()
    """The rollout's MPI: how its ranks are started and the networks they talk over. A plain string is `start`
    (`launch.mpi=none`, as before the section)."""
    gpu_gres: bool = True
    """The site schedules GPUs as GRES (most do): jobs ask for --gpus-per-node and steps bind each task to its
    GPUs. false: nothing asks Slurm for GPUs, and each task takes its GPUs from SLURM_LOCALID instead."""
    cpu_bind: str | None = "cores"
    """srun --cpu-bind of every step: each task pinned to its cpus_per_task cores. Null: the site's default."""
    container: ContainerConfig = ContainerConfig()
    """The image every role's steps run in, unless launch.<role>.container names its own."""
    account: str | None = None
    """Slurm --account of every job."""
    qos: str | None = None
    """Slurm --qos of every job."""
    modules: list[str] = Field(default_factory=list)
    """Environment modules every job loads first (`module load` each), e.g. ["cuda/12.4", "openmpi/4.1"]."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines every job runs before the roles start (e.g. "source /lustre/envs/rstar/bin/activate")."""
    python: str | None = None
    """The host Python that runs the supervisor and the roles not in a container; null: the one running `rstar-hpc
    launch` (a venv or site install on shared storage). A role in a container runs its image's python."""
    signal_lead_s: int = Field(90, ge=10)
    """Seconds before the time limit at which Slurm sends USR2: the roles save, the job requeues itself."""
    max_restarts: int = Field(20, ge=0)
    """Requeues a run's job may go through (time limits, preemption, node failures; SLURM_RESTART_COUNT); beyond
    it the job stops with a message saying so, and the run stays resumable by a new `rstar-hpc launch`."""
    role_restarts: int = Field(3, ge=0)
    """Within one job: how often a role whose processes died (a crash, a kill -9) is started again while the
    others keep running."""
    hang_timeout_s: float = Field(1800.0, ge=0)
    """A trainer or rollout whose heartbeat (RUN/heartbeat/<role>.json) is older than this is taken for hung: the
    supervisor (or submitit RoleJob) kills its step and starts it again, counted against role_restarts like a
    crash. Every phase beats at least every few minutes (a step's training, generation and engine start; waiting
    for the other role beats every few seconds); the longest silent one is a single checkpoint or policy write
    (a 14B model with its AdamW state is ~200 GB: minutes on a parallel file system), so 30 min leaves room for a
    slow one, and matches NCCL's own timeout. 0: never."""

    @field_validator("hang_timeout_s")
    @classmethod
    def _hang_timeout(cls, v: float) -> float:
        if 0 < v < 60:
            raise ValueError(f"launch.hang_timeout_s={v:g}: use 0 (off) or at least 60 s; shorter would kill roles "
                             f"in ordinary phases (a heartbeat comes every few seconds to minutes)")
        return v

    @field_validator("mpi", mode="before")
    @classmethod
    def _mpi(cls, v):
        return {"start": v} if isinstance(v, str) else v
