"""An emulated multi-node Slurm cluster on this machine: real munged, slurmctld and one slurmd per node.

For development, tests and the demo; on a real cluster none of this is needed. Everything lives under
one state directory (config, munge key and socket, controller state, per-node spool/log/pid files):

    <state>/slurm.conf  cluster.json  munge.key  munge.sock  env.sh  pids.json  jobcomp.log
    <state>/ctld/       controller state, log, pid          <state>/nodes/<node>/  spool, log, pid
    <state>/munge/      munged's pid, log and seed

Nodes stand for the roles: `gpu[1-N]` (partition `gpu`, feature `gpu`: trainer and rollout) and
`cpu[1-M]` (partition `cpu`, feature `cpu`: sandbox). With `gpus_per_node`, the gpu nodes carry that many fake GPUs
(GRES over placeholder device files) and tasks are bound to their cores (task/affinity): `srun --gpus-per-task`
then sets CUDA_VISIBLE_DEVICES per task as on a real GPU partition, while the roles still compute on CPU. Every node is
localhost on its own slurmd port, or (`hosts`, hosts.py) a host of its own: its network namespace on a private bridge,
its hostname, /tmp and /dev/shm. `SlurmdParameters=config_overrides` lets each claim more CPUs than the machine has. Scheduling is tuned
so jobs (heterogeneous ones included, which only the backfill scheduler starts) begin within seconds.

Clients find the cluster through `SLURM_CONF=<state>/slurm.conf` (`source <state>/env.sh`). `down`
signals only the pids recorded at `up`, after checking each still is the daemon it was.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

from rstar_hpc.cluster.hosts import HostsError, NodeHosts

STATE_ENV = "RSTAR_HPC_CLUSTER_DIR"
DAEMONS = ("munged", "slurmctld", "slurmd")


class ClusterError(RuntimeError):
    """The local cluster could not be started or reached; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    num_gpu_nodes: int = 2
    num_cpu_nodes: int = 2
    cpus_per_node: int = 4
    memory_mb_per_node: int = 8000
    gpus_per_node: int = 0
    """Fake GPUs of each gpu node (GRES over placeholder device files). Non-zero also turns on task/affinity
    CPU binding, so that steps bind tasks to their GPUs and cores as a real GPU partition does."""
    name: str = "rstar"
    slurmd_timeout_s: int = 60
    """SlurmdTimeout: how long a node's slurmd may be silent before Slurm marks the node DOWN (it pings every third of
    it). A test that loses a node for good sets it short; a slurmd that is down for less goes unnoticed."""
    hosts: bool = False
    """Each node its own host (hosts.py): network, hostname, /tmp and /dev/shm of its own. Needs root."""
    shared: tuple[str, ...] = ()
    """With `hosts`: paths under /tmp that stand for shared storage (a run root), seen the same on every node (the
    state directory always is)."""

    def __post_init__(self):
        object.__setattr__(self, "shared", tuple(self.shared))   # a list from cluster.json


def default_state_dir() -> Path:
    # short on purpose: munge's socket path must fit in a sockaddr_un (108 bytes)
    return Path(os.environ.get(STATE_ENV) or Path.home() / ".rstar-hpc" / "cluster").absolute()


def _free_port_range(count: int, start: int = 17100, stop: int = 40000) -> int:
    """First port p such that p .. p+count-1 are all free on localhost."""
    p = start
    while p + count < stop:
        for i in range(count):
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", p + i))
                except OSError:
                    p = p + i + 1
                    break
        else:
            return p
    raise ClusterError(f"no {count} consecutive free ports between {start} and {stop}")


class LocalCluster:
    def __init__(self, state_dir: str | os.PathLike | None = None, spec: ClusterSpec | None = None):
        self.dir = Path(state_dir).absolute() if state_dir else default_state_dir()
        saved = self.dir / "cluster.json"
        if spec is None and saved.is_file():     # status/down of a cluster started with another shape
            spec = ClusterSpec(**json.loads(saved.read_text()))
        self.spec = spec or ClusterSpec()
        self.hosts = NodeHosts(self.dir, self.node_names, self.spec.shared) if self.spec.hosts else None
        if len(str(self.dir / "munge.sock")) > 100:
            raise ClusterError(f"state directory {self.dir} is too long for a Unix socket path; pick a shorter one "
                               f"(--state-dir or ${STATE_ENV})")

    # ---- paths and environment -------------------------------------------------------------------
    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm clients (sbatch, srun, squeue) of this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    @property
    def node_names(self) -> list[str]:
        return ([f"gpu{i}" for i in range(1, self.spec.num_gpu_nodes + 1)]
                + [f"cpu{i}" for i in range(1, self.spec.num_cpu_nodes + 1)])

    def _pids_file(self) -> Path:
        return self.dir / "pids.json"

    def _recorded(self) -> dict[str, int]:
        try:
            return json.loads(self._pids_file().read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    # ---- lifecycle -------------------------------------------------------------------------------
    def up(self, timeout_s: float = 60.0) -> LocalCluster:
        """Start the cluster, or return at once if this state directory's cluster is already healthy."""
        self._check_binaries()
        if self.is_up():
            running = json.loads((self.dir / "cluster.json").read_text())
            if ClusterSpec(**running) != self.spec:   # a cluster.json from before a field was added: its default
                raise ClusterError(f"the cluster in {self.dir} is up with another shape ({running}); "
                                   f"`rstar-hpc cluster down` first, or use another --state-dir")
            return self
        if self._recorded():
            self.down()   # stale or half-dead: start clean
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self._write_munge_key()
        (self.dir / "cluster.json").write_text(json.dumps(dataclasses.asdict(self.spec)))
        ports = _free_port_range(1 + len(self.node_names))
        try:
            addresses = self.hosts.up() if self.hosts else None
        except HostsError as e:
            raise ClusterError(str(e)) from None
        self.conf.write_text(self._render_conf(ctld_port=ports, node_port=ports + 1, addresses=addresses))
        self._write_gres()
        (self.dir / "env.sh").write_text(f"export SLURM_CONF={self.conf}\n")
        pids: dict[str, int] = {}
        try:
            pids["munged"] = self._start_munged()
            self._save_pids(pids)
            pids["slurmctld"] = self._start(["slurmctld", "-f", str(self.conf)], self.dir / "ctld" / "slurmctld.pid",
                                            "slurmctld", self.dir / "ctld" / "slurmctld.log")
            self._save_pids(pids)
            for node in self.node_names:
                (self.dir / "nodes" / node / "spool").mkdir(parents=True, exist_ok=True)
                pids[f"slurmd:{node}"] = self._start(
                    self._on_node(node, ["slurmd", "-f", str(self.conf), "-N", node]),
                    self.dir / "nodes" / node / "slurmd.pid", f"slurmd {node}", self.dir / "nodes" / node / "slurmd.log")
                self._save_pids(pids)
            self._wait_idle(timeout_s)
        except BaseException:
            self.down()
            raise
        return self

    def down(self, timeout_s: float = 20.0) -> list[str]:
        """Cancel this cluster's jobs, then stop the daemons recorded at `up` (and only those), then (`hosts`)
        remove the nodes' namespaces and links."""
        recorded = self._recorded()
        if not recorded:
            return self.hosts.down() if self.hosts else []
        if self._alive("slurmctld", recorded.get("slurmctld")) and (jobs := self._all_job_ids()):
            subprocess.run(["scancel", "--full", "--quiet", *jobs], env=self.env, capture_output=True, timeout=15)
            self._wait(lambda: not self._all_job_ids(), 10)
        stopped = []
        # nodes first, controller next, munge last: each still needs the ones after it to shut down cleanly
        order = sorted(recorded, key=lambda k: (k == "munged", k == "slurmctld"))
        for key in order:
            pid = recorded[key]
            if self._alive(key, pid):
                os.kill(pid, signal.SIGTERM)
                if not self._wait(lambda: not self._alive(key, pid), timeout_s):
                    os.kill(pid, signal.SIGKILL)
                    self._wait(lambda: not self._alive(key, pid), 5)
                stopped.append(f"{key}[{pid}]")
        self._pids_file().unlink(missing_ok=True)
        return stopped + (self.hosts.down() if self.hosts else [])

    def kill_node(self, node: str) -> int:
        """SIGKILL one node's slurmd (a crashed node daemon: its jobs' processes keep running); returns its pid."""
        key = f"slurmd:{node}"
        pid = self._recorded().get(key)
        if not self._alive(key, pid):
            raise ClusterError(f"slurmd of {node} is not running")
        os.kill(pid, signal.SIGKILL)
        self._wait(lambda: not self._alive(key, pid), 10)
        return pid

    def lose_node(self, node: str) -> list[int]:
        """Lose a node for good, as far as this machine can: SIGKILL its slurmd AND every process of its job steps
        (a real lost node takes them with it; here they would run on). On a cluster of hosts that is every process in
        the node's network namespace. On the plain cluster, a step's processes are its slurmstepd (found by its socket
        in the node's spool directory) and that one's descendants, and any process whose environment names this node
        and this cluster (one that left the tree). Returns the pids killed, slurmd's first. Slurm marks the node DOWN
        once it has been silent for `slurmd_timeout_s`; `start_node` brings it back (a fresh /tmp on hosts, as after
        a reboot)."""
        killed = [self.kill_node(node)]
        if self.hosts:   # until none is left: a process may fork while its siblings die, or be seen before it is reaped
            self._wait(lambda: not self._sweep(node, killed), 10, interval=0.1)
            return killed
        for pid in self._node_step_processes(node):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        return killed

    def _sweep(self, node: str, killed: list[int]) -> list[int]:
        """(`hosts`) SIGKILL what is left in the node's namespace; what was."""
        left = [pid for pid in self.hosts.pids(node) if pid != os.getpid()]
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            if pid not in killed:
                killed.append(pid)
        return left

    def _node_step_processes(self, node: str) -> list[int]:
        """(plain cluster) A node's step processes: on hosts the stepds' sockets live in the node's namespace, out of
        this one's /proc/net/unix, and `_sweep` takes everything there instead."""
        spool = f"{self.dir / 'nodes' / node / 'spool'}/"
        inodes = {f"socket:[{parts[6]}]" for parts in (line.split() for line in
                  Path("/proc/net/unix").read_text().splitlines()[1:]) if len(parts) >= 8 and parts[7].startswith(spool)}
        parents, stepds, marked = {}, set(), set()
        env_keys = (f"SLURMD_NODENAME={node}".encode(), f"SLURM_CONF={self.conf}".encode())
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            pid = int(proc.name)
            try:
                parents[pid] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                environ = set((proc / "environ").read_bytes().split(b"\0"))
                if all(k in environ for k in env_keys):
                    marked.add(pid)
                if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                    stepds.add(pid)
            except (OSError, IndexError, ValueError):
                continue   # gone meanwhile
        found, todo = set(marked), list(stepds)
        while todo:   # the stepds and their descendants
            pid = todo.pop()
            found.add(pid)
            todo += [child for child, parent in parents.items() if parent == pid and child not in found]
        return sorted(found - {os.getpid()})

    def start_node(self, node: str, timeout_s: float = 60.0) -> int:
        """Start one node's slurmd again (after kill_node or lose_node), resume the node if Slurm still holds it DOWN
        (ReturnToService=2 usually returns it as its slurmd registers), and wait until every node answers."""
        if node not in self.node_names:
            raise ClusterError(f"no node {node!r}; nodes: {', '.join(self.node_names)}")
        pids = self._recorded()
        pids[f"slurmd:{node}"] = self._start(self._on_node(node, ["slurmd", "-f", str(self.conf), "-N", node]),
                                             self.dir / "nodes" / node / "slurmd.pid", f"slurmd {node}",
                                             self.dir / "nodes" / node / "slurmd.log")
        self._save_pids(pids)
        if not self._wait(self._sinfo_ok, min(15.0, timeout_s), interval=0.5):   # a node Slurm marked DOWN: resume it
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], env=self.env,
                           capture_output=True, timeout=30)
        self._wait_idle(timeout_s)
        return pids[f"slurmd:{node}"]

    def cut_node(self, node: str, cut: bool = True) -> None:
        """(`hosts`) Cut `node` off the network, or (cut=False) mend it: a partition; its processes run on."""
        if self.hosts is None:
            raise ClusterError("only a cluster of hosts (cluster up --hosts) has links to cut")
        self.hosts.set_link(node, up=not cut)

    def _on_node(self, node: str, cmd: list[str]) -> list[str]:
        return self.hosts.on_node(node, cmd) if self.hosts else cmd

    def is_up(self) -> bool:
        recorded = self._recorded()
        expected = {"munged", "slurmctld", *(f"slurmd:{n}" for n in self.node_names)}
        if set(recorded) != expected or not all(self._alive(k, p) for k, p in recorded.items()):
            return False
        return self._sinfo_ok()

    def status(self) -> dict:
        recorded = self._recorded()
        daemons = {k: {"pid": p, "alive": self._alive(k, p)} for k, p in recorded.items()}
        nodes = {}
        if recorded and daemons.get("slurmctld", {}).get("alive"):
            out = subprocess.run(["sinfo", "-N", "-h", "-o", "%N %P %T %f %c"], env=self.env, capture_output=True,
                                 text=True, timeout=10)
            for line in out.stdout.splitlines():
                name, part, state, feat, cpus = line.split()
                nodes[name] = {"partition": part.rstrip("*"), "state": state, "features": feat, "cpus": int(cpus)}
        return {"state_dir": str(self.dir), "slurm_conf": str(self.conf), "daemons": daemons, "nodes": nodes}

    # ---- helpers ---------------------------------------------------------------------------------
    def _check_binaries(self) -> None:
        missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo") if not shutil.which(b)]
        if missing:
            raise ClusterError(f"missing {', '.join(missing)}: install the Debian packages with "
                               f"`bash scripts/install-system.sh` (slurmctld slurmd slurm-client munge)")

    def _write_munge_key(self) -> None:
        key = self.dir / "munge.key"
        if not key.exists():
            key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o400)

    def _start_munged(self) -> int:
        d = self.dir / "munge"
        d.mkdir(exist_ok=True)
        sock = self.dir / "munge.sock"
        sock.unlink(missing_ok=True)
        cmd = ["munged", "--force", f"--socket={sock}", f"--key-file={self.dir / 'munge.key'}",
               f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munged.seed'}"]
        return self._start(cmd, d / "munged.pid", "munged", d / "munged.log")

    def _start(self, cmd: list[str], pid_file: Path, what: str, log: Path) -> int:
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        pid_file.unlink(missing_ok=True)
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise ClusterError(f"{what} failed to start (exit {proc.returncode}): {proc.stderr.strip()[-500:]}\n"
                               f"  log: {log}")
        if not self._wait(lambda: pid_file.is_file() and pid_file.read_text().strip(), 15):
            raise ClusterError(f"{what} started but wrote no pid file {pid_file}; see {log}")
        return int(pid_file.read_text().split()[0])

    def _save_pids(self, pids: dict[str, int]) -> None:
        tmp = self._pids_file().with_suffix(".tmp")
        tmp.write_text(json.dumps(pids, indent=1))
        os.replace(tmp, self._pids_file())

    def _alive(self, key: str, pid: int | None) -> bool:
        """The pid is alive AND is still the daemon we started (pids are reused)."""
        if not pid:
            return False
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            return False
        daemon = key.split(":")[0]
        if not cmdline or not os.path.basename(cmdline[0].decode(errors="replace")).startswith(daemon):
            return False
        try:
            status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            return False
        return status != "Z" and str(self.dir).encode() in b" ".join(cmdline)

    def _sinfo_ok(self) -> bool:
        try:
            out = subprocess.run(["sinfo", "-N", "-h", "-o", "%N %T"], env=self.env, capture_output=True, text=True,
                                 timeout=10)
        except subprocess.TimeoutExpired:
            return False
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        # busy states (allocated, completing, ...) are healthy; '*' means the node is not responding
        return out.returncode == 0 and all(
            n in states and not states[n].endswith("*") and not any(
                bad in states[n].lower() for bad in ("down", "drain", "fail", "unknown", "not_responding"))
            for n in self.node_names)

    def _wait_idle(self, timeout_s: float) -> None:
        if not self._wait(self._sinfo_ok, timeout_s, interval=0.5):
            out = subprocess.run(["sinfo", "-N"], env=self.env, capture_output=True, text=True).stdout
            raise ClusterError(f"nodes did not become idle within {timeout_s:.0f} s:\n{out}\n"
                               f"  logs: {self.dir}/ctld/slurmctld.log, {self.dir}/nodes/*/slurmd.log")

    def _all_job_ids(self) -> list[str]:
        """The controller's jobs; none when it does not answer in 10 s (one SIGKILLed a moment ago still looked
        alive to `down`, and squeue then waited on it past any timeout)."""
        try:
            out = subprocess.run(["squeue", "-h", "-o", "%A"], env=self.env, capture_output=True, text=True,
                                 timeout=10)
        except subprocess.TimeoutExpired:
            return []
        return out.stdout.split() if out.returncode == 0 else []

    @staticmethod
    def _wait(pred, timeout_s: float, interval: float = 0.2) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if pred():
                return True
            time.sleep(interval)
        return bool(pred())

    def _binding_lines(self) -> list[str]:
        if not self.spec.gpus_per_node:
            return ["TaskPlugin=task/none"]
        # task/affinity: steps bind each task to its cores (--cpus-per-task, --cpu-bind) as GPU partitions do
        return ["TaskPlugin=task/affinity", "GresTypes=gpu"]

    def _write_gres(self) -> None:
        """gres.conf (read from beside slurm.conf) over placeholder files standing for /dev/nvidia*: slurmd only
        needs them to exist without cgroup device confinement; it then sets CUDA_VISIBLE_DEVICES per task."""
        n = self.spec.gpus_per_node
        if not n:
            (self.dir / "gres.conf").unlink(missing_ok=True)
            return
        dev = self.dir / "dev"
        dev.mkdir(exist_ok=True)
        for i in range(n):
            node = dev / f"nvidia{i}"
            if not node.is_char_device():
                node.unlink(missing_ok=True)
                try:   # slurmd takes only device files for GRES (nothing opens them: no cgroup confinement here)
                    os.mknod(node, stat.S_IFCHR | 0o600, os.makedev(195, i))
                except PermissionError as e:
                    raise ClusterError(f"fake GPUs need device files, and creating {node} was refused ({e}); run "
                                       f"`cluster up --gpus-per-node` as root") from None
        files = f"{dev}/nvidia[0-{n - 1}]" if n > 1 else f"{dev}/nvidia0"
        (self.dir / "gres.conf").write_text(f"# fake GPUs of the emulated cluster (rstar-hpc cluster up --gpus-per-node)\n"
                                            f"NodeName=gpu[1-{self.spec.num_gpu_nodes}] Name=gpu File={files}\n")

    def _render_conf(self, ctld_port: int, node_port: int, addresses: dict[str, str] | None = None) -> str:
        s, d = self.spec, self.dir
        user = pwd.getpwuid(os.getuid()).pw_name
        n_gpu, n_cpu = s.num_gpu_nodes, s.num_cpu_nodes
        last_port = node_port + n_gpu + n_cpu - 1
        node_line = (f"CPUs={s.cpus_per_node} RealMemory={s.memory_mb_per_node} NodeHostname=localhost "
                     f"NodeAddr=127.0.0.1 State=UNKNOWN")
        gres = f" Gres=gpu:{s.gpus_per_node}" if s.gpus_per_node else ""
        if addresses:   # hosts: each node its own address and hostname, one slurmd port (one per network)
            size = f"CPUs={s.cpus_per_node} RealMemory={s.memory_mb_per_node} State=UNKNOWN Port={node_port}"
            nodes = [f"NodeName={n} NodeHostname={n} NodeAddr={a} Feature={n.rstrip('0123456789')} {size}"
                     + (gres if n.startswith("gpu") else "") for n, a in addresses.items()]
            ctld = f"{socket.gethostname()}({self.hosts.gateway()})"
        else:
            nodes = [f"NodeName=gpu[1-{n_gpu}] Port={node_port}-{node_port + n_gpu - 1} Feature=gpu {node_line}{gres}",
                     f"NodeName=cpu[1-{n_cpu}] Port={node_port + n_gpu}-{last_port} Feature=cpu {node_line}"]
            ctld = "localhost"
        lines = [
            "# Generated by `rstar-hpc cluster up`: an emulated cluster on one host. Do not use in production.",
            f"ClusterName={s.name}",
            # job ids of their own: two clusters up at once (two test workers) never hand out the same id, which
            # names log files and derives the trainer's rendezvous port (launch/roles.py)
            f"FirstJobId={ctld_port * 1000}",
            f"SlurmctldHost={ctld}",
            f"SlurmctldPort={ctld_port}",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: a requeued job waits this long before it may start again (default 120 s)
            f"AuthInfo=socket={d}/munge.sock,cred_expire=10",
            f"StateSaveLocation={d}/ctld/state",
            f"SlurmctldPidFile={d}/ctld/slurmctld.pid",
            f"SlurmctldLogFile={d}/ctld/slurmctld.log",
            # %n: one spool/pid/log per emulated node, or the second slurmd kills the first
            f"SlurmdSpoolDir={d}/nodes/%n/spool",
            f"SlurmdPidFile={d}/nodes/%n/slurmd.pid",
            f"SlurmdLogFile={d}/nodes/%n/slurmd.log",
            "SlurmdParameters=config_overrides",
            "ProctrackType=proctrack/linuxproc",
            *self._binding_lines(),
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={d}/jobcomp.log",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            # hetjobs are started only by backfill: run it every second, not every 30
            "SchedulerParameters=bf_interval=1,sched_min_interval=100000,defer_batch",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            "ReturnToService=2",
            "MinJobAge=600",
            "KillWait=5",
            "SlurmctldTimeout=30",
            f"SlurmdTimeout={s.slurmd_timeout_s}",
            "InactiveLimit=0",
            "Waittime=0",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            *nodes,
            f"PartitionName=gpu Nodes=gpu[1-{n_gpu}] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
            f"PartitionName=cpu Nodes=cpu[1-{n_cpu}] MaxTime=INFINITE State=UP OverSubscribe=NO",
        ]
        return "\n".join(lines) + "\n"
