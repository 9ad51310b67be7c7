"""How the rollout's ranks reach each other: every rank is an MPI process of its own (a singleton), joined to rank 0
by MPI_Comm_connect / MPI_Comm_accept, so one engine's death ends no other rank's MPI.

One MPI world for all ranks (srun --mpi=pmix, mpirun) shares its fate: a rank killed by a CUDA error, an
out-of-memory or a node's driver reset takes the launcher's step down, and every engine with it. Here each engine
rank has its own intercommunicator with rank 0; rank 0 keeps accepting, so an engine started again (rollout/keeper.py)
joins the running job. The wire-up goes through Open MPI's `ompi-server`, which the keeper of rank 0 starts: each
rank's MPI finds it through OMPI_MCA_pmix_server_uri, and the port rank 0 accepts on is a file of the session.

    RUN/rendezvous/rollout/<session>/ompi-server.uri   the name server's address (ompi-server -r)
                                     port               rank 0's MPI port
                                     engine-<r>.json    the keeper's word on engine rank r: its process died
                                     over               rank 0 has left: keepers start nothing more

Where no engine needs to fail alone, or the MPI cannot join (Open MPI 5, MPICH), launch.mpi.start=world makes every
rank a task of one MPI world instead (srun --mpi=pmix): WorldLinks and EngineLink.world speak COMM_WORLD.

Only Open MPI 4 can join (join_problem): Open MPI 5 removed ompi-server, and its singletons cannot connect at all
(docs/reliability.md, "Which MPI"). The launch refuses another MPI before it submits, and the ranks refuse it at
once rather than retrying a join that cannot succeed.

The session is the launcher step (SLURM_JOB_ID.SLURM_STEP_ID) or a keeper's own name, so a restarted role never
meets the files of the last one. `RankZeroLinks` and `EngineLink` look like the communicator the scheduler and the
engine loop used before (isend/send/Iprobe/recv with ranks), so the MPI conversation (mpi.py) is unchanged.
"""
from __future__ import annotations

import fcntl
import ipaddress
import json
import logging
import os
import queue
import socket
import struct
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rstar_hpc.exchange.atomic import atomic_write_json, atomic_write_text
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.rollout.mpi import TAG_DEAD, TAG_JOIN

RANK_ENV, LOCAL_RANK_ENV, SIZE_ENV, SESSION_ENV = ("RSTAR_ROLLOUT_RANK", "RSTAR_ROLLOUT_LOCAL_RANK",
                                                   "RSTAR_ROLLOUT_SIZE", "RSTAR_ROLLOUT_SESSION")
REPORT_POLL_S = 0.5   # how often rank 0 looks for the keepers' death reports (a stat per engine)
ACCEPT_FAILURES = 10   # accepts failing in a row before rank 0 stops accepting engines
log = logging.getLogger("rstar_hpc.rollout")


@dataclass(frozen=True)
class Session:
    """The files through which one rollout job's ranks find each other."""
    dir: Path
    rank: int
    size: int

    @classmethod
    def from_env(cls, paths: RunPaths, env=None) -> Session:
        env = os.environ if env is None else env
        missing = [k for k in (RANK_ENV, SIZE_ENV, SESSION_ENV) if k not in env]
        if missing:
            raise RuntimeError(f"a rollout rank needs {', '.join(missing)}: start it with `rstar-hpc rollout`, whose "
                               f"keeper sets them, not the rank's command directly")
        return cls(session_dir(paths, env[SESSION_ENV]), int(env[RANK_ENV]), int(env[SIZE_ENV]))

    @property
    def uri(self) -> Path:
        return self.dir / "ompi-server.uri"

    @property
    def port(self) -> Path:
        return self.dir / "port"

    @property
    def over(self) -> Path:
        return self.dir / "over"

    def engine_report(self, rank: int) -> Path:
        return self.dir / f"engine-{rank}.json"

    def restart_request(self, rank: int) -> Path:
        return self.dir / f"restart-{rank}.json"


# What was measured joining separately started singletons (one A, a B that joins, is SIGKILLed and joins again), with
# mpi4py 4.1.2; docs/reliability.md has the table. The verdicts here are the launch's and the ranks'.
_OPEN_MPI_5 = ("Open MPI 5 cannot join ranks started apart: it has no ompi-server, and its singletons have no PMIx "
               "server, so MPI_Comm_accept/MPI_Comm_connect and MPI_Comm_join fail at once with MPI_ERR_INTERN "
               "(tried on 5.0.11 with the port in a file, over a socket, and pointed at a PRRTE DVM); the DVM's "
               "client, `prterun --dvm` (and `mpirun --dvm`), crashed with SIGSEGV (openpmix/prrte issue 2364); ULFM "
               "keeps every rank in one mpirun's world, which a separately started engine cannot join")
_MPICH = ("MPICH's singletons cannot join: MPI_Comm_connect and MPI_Comm_join failed with \"Local and remote groups in "
          "MPI_Intercomm_create must not contain the same processes\" (tried on MPICH 5.0.2; pmodels/mpich issue "
          "7805; they did join with each process under an `mpiexec -n 1` of its own, which the keeper does not do)")


def mpi_name(version: str) -> str:
    """The MPI's name and version from its MPI_Get_library_version: the first line up to its first comma ("Open MPI
    v5.0.11", "MPICH Version:      5.0.2"); "" for none."""
    return (version.strip("\x00").strip().splitlines() or [""])[0].split(",")[0].strip()


def join_problem(version: str) -> str | None:
    """Why the rollout's ranks cannot join rank 0 on the MPI whose MPI_Get_library_version begins `version`; None:
    they can (Open MPI 4, through ompi-server)."""
    name = mpi_name(version) or "an MPI that gave no version"
    if name.startswith("Open MPI v4"):
        return None
    if name.startswith("Open MPI v"):
        return f"{name}: {_OPEN_MPI_5}"
    if name.startswith("MPICH"):
        return f"{name}: {_MPICH}"
    return (f"{name} was not tried: the rollout's ranks join through Open MPI 4's ompi-server, which it does not "
            f"have")


def world_problem(version: str, plugin: str) -> str | None:
    """launch.mpi.start=world: why srun --mpi=`plugin` cannot start one world of the MPI whose MPI_Get_library_version
    is `version` (all of it: MPICH's names its configure options); None: it can, or this was not tried."""
    name = " ".join(mpi_name(version).split())
    if name.startswith("Open MPI v") and not name.startswith("Open MPI v4") and plugin != "pmix":
        return (f"{name} speaks PMIx only: under srun --mpi={plugin} each task starts as an MPI world of its own (a "
                f"singleton; tried on 5.0.11). Set launch.mpi.plugin=pmix")
    if name.startswith("MPICH") and plugin == "pmix":
        configure = next((line for line in version.splitlines() if "configure" in line), "")
        if "pmix" not in configure.lower():
            return (f"{name} was built without PMIx ({configure.split(':', 1)[-1].strip() or 'its configure line'}): "
                    f"under srun --mpi=pmix its ranks abort in MPI_Init (\"unsupported PMI version PMIx\", tried on "
                    f"the PyPI mpich 5.0.2). Set launch.mpi.plugin=pmi2")
    return None


def check_world(MPI, env=os.environ) -> None:
    """launch.mpi.start=world: this rank's MPI world must be its srun step (RANK_ENV of SIZE_ENV tasks). An MPI that
    did not find srun's PMI makes each task a world of one, where every task would be rank 0: stop at once, saying
    so, rather than run a step of schedulers without engines."""
    size, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    want = int(env.get(SIZE_ENV) or env.get("SLURM_STEP_NUM_TASKS") or size)
    me = int(env.get(RANK_ENV) or env.get("SLURM_PROCID") or rank)
    if (size, rank) != (want, me):
        raise RuntimeError(f"srun started {want} rollout tasks, but this one (task {me}) is rank {rank} of an MPI "
                           f"world of {size}: {mpi_name(MPI.Get_library_version())} did not find srun's PMI (srun "
                           f"--mpi=<launch.mpi.plugin>). Open MPI 4.1 and 5 speak pmix; MPICH takes pmi2 (pmix only "
                           f"where built with PMIx); `srun --mpi=list` shows what this Slurm has")


def refuse_unjoinable(MPI) -> None:
    """Stop a rank at once on an MPI whose ranks cannot join (its joins would fail until the job's timeouts)."""
    problem = join_problem(MPI.Get_library_version())
    if problem:
        raise RuntimeError(f"the rollout's ranks cannot join on this MPI: {problem}. Run the rollout on Open MPI 4.1 "
                           f"(see `rstar-hpc launch`'s refusal for the ways)")


def session_dir(paths: RunPaths, session: str) -> Path:
    return paths.rendezvous_dir("rollout") / session


def mpi_env(session: Session, interfaces: list[str] | None = None) -> dict[str, str]:
    """What a rank's MPI (and the name server) needs before MPI_Init: where the session's name server is, and the
    interfaces to talk over (node_interfaces)."""
    env = {"OMPI_MCA_pmix_server_uri": f"file:{session.uri}"}
    if os.geteuid() == 0:   # containers run as root; Open MPI refuses it unless told
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if interfaces:
        env.update(OMPI_MCA_btl_tcp_if_include=",".join(interfaces), OMPI_MCA_oob_tcp_if_include=",".join(interfaces))
    return env


def node_interfaces(configured: list[str], env=None) -> list[str]:
    """The interfaces this node's ranks talk over: launch.mpi.interfaces, else the one holding the node's Slurm
    address (NodeAddr), which the other nodes reach it by. Empty (Open MPI's own choice): that address is a loopback
    one (every node one host) or is not found here. Without it a multi-homed node (ib0, eth0, docker0) may publish
    an address of a network the other nodes are not on, and the engines never join."""
    if configured:
        return list(configured)
    env = os.environ if env is None else env
    addr = _slurm_node_addr(env.get("SLURMD_NODENAME"))
    if addr is None or ipaddress.ip_address(addr).is_loopback:
        return []
    found = [name for _, name in socket.if_nameindex() if _ipv4_of(name) == addr]
    if not found:
        log.warning("no interface holds this node's Slurm address %s; Open MPI picks the interfaces (set "
                    "launch.mpi.interfaces if the engines do not join)", addr)
    return found[:1]


def _slurm_node_addr(node: str | None) -> str | None:
    """The node's NodeAddr (an address, or a name resolved here), from scontrol; None outside Slurm."""
    if not node:
        return None
    try:
        out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True,
                             timeout=15).stdout
        addr = next(w.split("=", 1)[1] for w in out.split() if w.startswith("NodeAddr="))
        return socket.gethostbyname(addr)
    except (OSError, subprocess.SubprocessError, StopIteration):
        return None


def _ipv4_of(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:   # SIOCGIFADDR: the interface's IPv4 address
            raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", interface[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def wait_for(path: Path, timeout_s: float, what: str, give_up: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if give_up is not None and give_up.exists():
            raise RuntimeError(f"rank 0 left before {what} appeared")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} ({path}) did not appear in {timeout_s:.0f}s")
        time.sleep(0.1)


class _Sent:
    """A send that had no one to go to (the engine is gone): complete at once, like a request to a dead peer."""

    def Test(self) -> bool:
        return True


class RankZeroLinks:
    """Rank 0's intercommunicators, one per engine rank, behind the communicator calls the scheduler makes.
    Engines join whenever they start (a thread accepts them); an engine whose keeper reports its process dead reads
    as that engine's DEAD message, so the step re-runs its work at once instead of after engine_timeout_s."""

    def __init__(self, MPI, session: Session):
        self.MPI, self.session = MPI, session
        self.links: dict[int, object] = {}     # engine rank -> its intercommunicator (the live incarnation)
        self.pids: dict[int, int] = {}         # engine rank -> the process of that incarnation
        self.joined: list[int] = []            # engine ranks that joined since take_joined()
        self._queue: queue.Queue = queue.Queue()
        self._inbox: list[tuple[int, int, object]] = []   # synthesized messages: (source, tag, payload)
        self._held: list = []                  # blocking sends made non-blocking: their requests, kept alive
        self._last_report_poll = 0.0
        self._turn = 0
        refuse_unjoinable(MPI)
        self.port = MPI.Open_port()
        atomic_write_text(session.port, self.port)
        threading.Thread(target=self._accept, name="rollout-accept", daemon=True).start()

    def _accept(self) -> None:
        """Accept engines for the life of the job (the thread dies with the process: rank 0 never finalizes). A
        failing accept is tried again after a pause; one that keeps failing (the name server gone: the job is
        ending) stops the acceptor."""
        MPI, failures = self.MPI, 0
        while failures < ACCEPT_FAILURES:
            try:
                ic = MPI.COMM_SELF.Accept(self.port)
                ic.Set_errhandler(MPI.ERRORS_RETURN)
                hello = ic.recv(source=0, tag=TAG_JOIN)
            except Exception as e:   # noqa: BLE001 - one engine's failed join must not end the acceptor
                failures += 1
                log.error("accepting an engine rank failed (%d of %d): %s", failures, ACCEPT_FAILURES, e)
                time.sleep(2.0)
                continue
            failures = 0
            log.info("engine rank %d joined (pid %d)", hello["rank"], hello["pid"])
            self._queue.put((int(hello["rank"]), int(hello["pid"]), ic))

    # -- who is there --------------------------------------------------------------------------------------------
    def poll(self) -> None:
        """Take in the engines that joined and the keepers' death reports."""
        while True:
            try:
                rank, pid, ic = self._queue.get_nowait()
            except queue.Empty:
                break
            self.links[rank], self.pids[rank] = ic, pid
            self._inbox = [m for m in self._inbox if m[0] != rank]   # the last incarnation's death is over
            self.joined.append(rank)
        now = time.monotonic()
        if now - self._last_report_poll >= REPORT_POLL_S:
            self._last_report_poll = now
            for rank in list(self.links):
                report = _read_json(self.session.engine_report(rank))
                if report and report.get("pid") == self.pids.get(rank):
                    self.links.pop(rank)
                    self._inbox.append((rank, TAG_DEAD, f"its process {report['pid']} ended ({report['exit']})"))

    def request_restart(self, rank: int, why: str) -> None:
        """Ask engine rank `rank`'s keeper to kill its process whole and start it again (rank 0 judged it hung: it
        may be too stuck to leave on its own). Named by pid: a later incarnation is not touched."""
        pid = self.pids.get(rank)
        if pid is not None:
            atomic_write_json(self.session.restart_request(rank), {"rank": rank, "pid": pid, "why": why,
                                                                   "time": time.time()})

    def wait_joined(self, timeout_s: float, stop=lambda: None) -> list[int]:
        """Wait until every engine rank has joined (or `timeout_s`); the ranks missing."""
        deadline = time.monotonic() + timeout_s
        while len(self.links) < self.session.size - 1 and time.monotonic() < deadline and not stop():
            self.poll()
            time.sleep(0.05)
        return [r for r in range(1, self.session.size) if r not in self.links]

    def take_joined(self) -> list[int]:
        self.poll()
        out, self.joined = self.joined, []
        return out

    def down(self) -> set[int]:
        """Engine ranks with no live process joined."""
        self.poll()
        return {r for r in range(1, self.session.size) if r not in self.links}

    # -- the communicator's calls -------------------------------------------------------------------------------
    def Get_size(self) -> int:
        return self.session.size

    def isend(self, obj, dest: int, tag: int):
        ic = self.links.get(dest)
        if ic is None:
            return _Sent()
        try:
            return ic.isend(obj, dest=0, tag=tag)
        except self.MPI.Exception:
            log.warning("a send to engine rank %d failed: its connection is gone", dest)
            return _Sent()

    def send(self, obj, dest: int, tag: int) -> None:
        self._held = [r for r in self._held if not r.Test()]
        self._held.append(self.isend(obj, dest, tag))   # never block on a peer that may be dead

    def Iprobe(self, source: int, tag: int, status) -> bool:
        self.poll()
        MPI = self.MPI
        for src, t, _ in self._inbox:
            if source in (MPI.ANY_SOURCE, src) and tag in (MPI.ANY_TAG, t):
                status.Set_source(src)
                status.Set_tag(t)
                return True
        ranks = sorted(self.links) if source == MPI.ANY_SOURCE else [source] if source in self.links else []
        self._turn += 1   # start the round at another engine each time: one busy engine cannot starve the rest
        for i in range(len(ranks)):
            rank = ranks[(self._turn + i) % len(ranks)]
            try:
                if self.links[rank].Iprobe(source=0, tag=tag, status=status):
                    status.Set_source(rank)
                    return True
            except MPI.Exception:
                self.links.pop(rank, None)
                self._inbox.append((rank, TAG_DEAD, "its connection to rank 0 broke"))
        return False

    def recv(self, source: int, tag: int):
        for i, (src, t, payload) in enumerate(self._inbox):
            if src == source and t == tag:
                del self._inbox[i]
                return payload
        return self.links[source].recv(source=0, tag=tag)


class WorldLinks:
    """Rank 0's links where every rank is a task of one MPI world (launch.mpi.start=world: srun --mpi=pmix, on any
    MPI srun can start). The engines are the world's other ranks, there from MPI_Init on: none joins later and none
    is reported dead, since a dead rank ends the world's step (srun --kill-on-bad-exit) and the supervisor starts
    the role again. No keeper can restart a hung or silent engine alone either: its restart request (`restart_wanted`)
    stops the role (the step's finished trajectories in its journal), and the supervisor starts it again whole."""

    def __init__(self, MPI):
        check_world(MPI)
        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.pids: dict[int, int] = {}
        self._held: list = []
        self.restart_wanted: str | None = None

    def request_restart(self, rank: int, why: str) -> None:
        self.restart_wanted = self.restart_wanted or (
            f"engine rank {rank} {why}; one MPI world cannot start an engine again alone, so the rollout role starts "
            f"again whole")

    def wait_joined(self, timeout_s: float, stop=lambda: None) -> list[int]:
        return []

    def take_joined(self) -> list[int]:
        return []

    def down(self) -> set[int]:
        return set()

    def Get_size(self) -> int:
        return self.comm.Get_size()

    def isend(self, obj, dest: int, tag: int):
        return self.comm.isend(obj, dest=dest, tag=tag)

    def send(self, obj, dest: int, tag: int) -> None:
        self._held = [r for r in self._held if not r.Test()]
        self._held.append(self.isend(obj, dest, tag))   # never block on a peer that may be stuck

    def Iprobe(self, source: int, tag: int, status) -> bool:
        return self.comm.Iprobe(source=source, tag=tag, status=status)

    def recv(self, source: int, tag: int):
        return self.comm.recv(source=source, tag=tag)


class EngineLink:
    """An engine rank's intercommunicator with rank 0 (its remote rank 0), which knows this rank's number."""

    def __init__(self, MPI, session: Session, timeout_s: float):
        refuse_unjoinable(MPI)
        wait_for(session.port, timeout_s, "rank 0's MPI port", give_up=session.over)
        self._ic = _connect(MPI, session, timeout_s)
        self._ic.send({"rank": session.rank, "pid": os.getpid()}, dest=0, tag=TAG_JOIN)
        self._rank, self._size = session.rank, session.size
        self._held: list = []

    @classmethod
    def world(cls, MPI) -> EngineLink:
        """An engine rank of one MPI world (launch.mpi.start=world): COMM_WORLD, whose rank 0 is rank 0."""
        check_world(MPI)
        link = cls.__new__(cls)
        link._ic, link._held = MPI.COMM_WORLD, []
        link._rank, link._size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        return link

    def send(self, obj, dest: int, tag: int) -> None:
        """Non-blocking, in order: a blocking send held the engine's event loop (and with it every trajectory's
        generation) while Open MPI set up the TCP connection to rank 0, seconds on a loaded machine."""
        self._held = [r for r in self._held if not r.Test()]
        self._held.append(self._ic.isend(obj, dest=dest, tag=tag))

    def flush(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for this rank's sends to leave (before it exits)."""
        from rstar_hpc.rollout.mpi import wait_sent
        return wait_sent(self._held, timeout_s)

    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return self._size

    def __getattr__(self, name):
        return getattr(self._ic, name)


def _connect(MPI, session: Session, timeout_s: float):
    """Connect to rank 0's port, again after a failure (a connect can time out while rank 0 accepts another rank:
    seen on a loaded 2-core machine) until `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return MPI.COMM_SELF.Connect(session.port.read_text().strip())
        except MPI.Exception as e:
            if time.monotonic() > deadline or session.over.exists():
                raise RuntimeError(f"engine rank {session.rank} could not connect to rank 0: {e}") from e
            log.warning("engine rank %d: connecting to rank 0 failed (%s); trying again", session.rank, e)
            time.sleep(2.0)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def take_restart_request(session: Session, rank: int, pid: int) -> str | None:
    """Rank 0's request that this keeper restart process `pid` of engine rank `rank` (its reason), taken: None if
    there is none for that process."""
    path = session.restart_request(rank)
    req = _read_json(path)
    if req is None:
        return None
    path.unlink(missing_ok=True)
    return str(req.get("why", "")) if req.get("pid") == pid else None


def report_engine_end(session: Session, rank: int, pid: int, exit_desc: str, restarts: int) -> None:
    """The keeper's word that engine rank `rank`'s process `pid` ended (rank 0 reads it in poll())."""
    atomic_write_json(session.engine_report(rank), {"rank": rank, "pid": pid, "exit": exit_desc,
                                                    "restarts": restarts, "time": time.time()})
