"""The session's set-up: its own $TMPDIR, how it stops on a signal (its fixtures torn down), the xdist groups of
files that share a costly fixture, and the shared fixtures: a real local Slurm cluster and a tiny model, each built
once per test session."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from tests.helpers import interrupts

# Nothing under test may reach for a model hub (there is none here, and compute nodes have no internet).
for _k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_k, "1")

REPO = Path(__file__).resolve().parents[1]
_SCRATCH = pytest.StashKey[str]()


def pytest_configure(config):
    """The session's scratch, removed when it ends: what the tests and the processes they start leave under $TMPDIR
    (a killed engine's IPC sockets and caches, a killed keeper's Open MPI folder, W&B's and multiprocessing's
    folders) goes there, not into the node's /tmp (a run once left ~60 entries). pytest's own tmp_path folders stay
    where they were, kept for a failure's post-mortem. Set by the controller; xdist workers and every process the
    tests start inherit it.

    SIGINT, SIGTERM and SIGHUP stop the session with its fixtures torn down (tests/helpers/interrupts.py), in the
    controller and in each xdist worker; the controller passes them on to its workers, interrupts itself when make
    takes one, sweeps the daemons of dead sessions first, and those of this session that outlived their teardown
    at its end (the scratch names them: every daemon the tests start inherits $TMPDIR)."""
    if hasattr(config, "workerinput"):
        interrupts.install()
        return
    interrupts.install(lambda: interrupts.children() if config.pluginmanager.hasplugin("dsession") else [])
    interrupts.watch_make()
    interrupts.report("dead sessions", interrupts.sweep_dead_sessions())
    root = tempfile.gettempdir()
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", root)
    config.stash[_SCRATCH] = os.environ["TMPDIR"] = tempfile.mkdtemp(prefix=interrupts.SCRATCH_PREFIX, dir=root)
    interrupts.claim(os.environ["TMPDIR"])
    tempfile.tempdir = None   # gettempdir() cached the old one


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish():
    interrupts.finishing()   # the fixtures' final teardown, and xdist's wait for its workers, run to their end


def pytest_unconfigure(config):
    scratch = config.stash.get(_SCRATCH, None)
    if scratch:
        interrupts.report("this session", interrupts.sweep_session(scratch))
        shutil.rmtree(scratch, ignore_errors=True)


# Files that read one session fixture too costly to build once per xdist worker run on one worker (`--dist loadfile`
# otherwise spreads them): the launched all-stage run and the installed wheel, and the model taught the tool format.
SHARED_FIXTURE_GROUPS = {
    "sbatch_run": ("tests/integration/test_launch.py", "tests/integration/test_installed.py",
                   "tests/integration/test_launch_chaos.py"),
    "tool_format_model": ("tests/rollout/test_e2e.py", "tests/rollout/test_levers_e2e.py"),
}


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    group_of = {f: g for g, files in SHARED_FIXTURE_GROUPS.items() for f in files}

    class FilesAndSharedFixtures(LoadFileScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return group_of.get(path, path)

        def _assign_work_unit(self, node) -> None:
            # the longest scopes first: xdist orders them by their number of tests, which put the shared launched
            # run (~15 min of one worker, few tests) last, and the suite ended on one worker while the other idled
            if not self.ordered:
                self.ordered = True
                queue = sorted(self.workqueue.items(), key=lambda kv: _slow_first(kv[0], len(kv[1])))
                self.workqueue.clear()
                self.workqueue.update(queue)
            super()._assign_work_unit(node)

    return FilesAndSharedFixtures(config, log)


def _slow_first(scope: str, tests: int) -> tuple:
    """Scheduling order: the shared-fixture groups, then the integration files (minute-scale runs each), then the
    rest by number of tests."""
    return (scope not in SHARED_FIXTURE_GROUPS, not scope.startswith("tests/integration/"), -tests)


def _local_cluster(prefix: str, spec=None):
    """Up a LocalCluster in a fresh short state directory (munge's socket path must fit), down and gone after."""
    from rstar_hpc.cluster import LocalCluster

    state = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    cluster = LocalCluster(state, spec)
    try:
        cluster.up()
        yield cluster
    finally:
        with interrupts.deferred():   # a stop signal meanwhile waits: a cluster half down leaves daemons behind
            cluster.down()
            shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real emulated cluster (munged, slurmctld, slurmd gpu1 gpu2 cpu1 cpu2) in a private state directory.

    `slurm_cluster.env` is the environment for Slurm clients (SLURM_CONF set). Stopped at session end."""
    yield from _local_cluster("rstar-cl-")


@pytest.fixture(scope="session")
def gpu_cluster():
    """A second emulated cluster whose gpu nodes carry 2 fake GPUs each (GRES) and bind tasks to cores
    (task/affinity): what a GPU partition does to placement, with the roles still computing on CPU."""
    from rstar_hpc.cluster import ClusterSpec

    yield from _local_cluster("rstar-gc-", ClusterSpec(gpus_per_node=2))


def _shared_storage(tmp_path_factory) -> tuple[str, ...]:
    """What stands for Lustre on a cluster of hosts: the session's scratch ($TMPDIR), pytest's folders and the
    checkout (a CI clone under /tmp too)."""
    return (os.environ["TMPDIR"], str(tmp_path_factory.getbasetemp()), str(REPO))


@pytest.fixture(scope="session")
def hosts_cluster(tmp_path_factory):
    """A cluster whose nodes are hosts (rstar_hpc/cluster/hosts.py: a network namespace on a private bridge, a
    hostname, /tmp and /dev/shm each): gpu[1-3] and cpu1, so a run's trainer, two-node rollout and sandbox each
    have hosts of their own. Skipped without root (network namespaces), which CI has."""
    from rstar_hpc.cluster import ClusterSpec

    if os.geteuid() != 0:
        pytest.skip("a cluster of hosts needs root (network namespaces)")
    yield from _local_cluster("rstar-hc-", ClusterSpec(num_gpu_nodes=3, num_cpu_nodes=1, hosts=True,
                                                       shared=_shared_storage(tmp_path_factory)))


@pytest.fixture(scope="module")
def chaos_cluster(tmp_path_factory):
    """The chaos run's own emulated cluster, with SlurmdTimeout=30: a node whose slurmd is killed for good goes DOWN
    within about a minute, one whose slurmd is back within 10 s stays up (Slurm pings every third of the timeout), and
    no other test lives with the short timeout. Its nodes are hosts where this runs as root (CI), so a lost node
    takes every process on it, and the sandbox that replaces it is reached across the bridge; the plain cluster
    elsewhere."""
    from rstar_hpc.cluster import ClusterSpec

    hosts = os.geteuid() == 0
    yield from _local_cluster("rstar-ch-", ClusterSpec(slurmd_timeout_s=30, hosts=hosts,
                                                       shared=_shared_storage(tmp_path_factory) if hosts else ()))


@pytest.fixture
def strand_cluster():
    """A cluster of its own with SlurmdTimeout=10 and spare nodes, whose nodes a test loses for good (a lost node stays
    lost: no other test lives on it)."""
    from rstar_hpc.cluster import ClusterSpec

    yield from _local_cluster("rstar-st-", ClusterSpec(num_gpu_nodes=5, num_cpu_nodes=2, slurmd_timeout_s=10))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The default tiny Qwen3 model (configs/tiny-cpu.yaml's spec), built once."""
    from rstar_hpc.config.run import TinyModelSpec
    from rstar_hpc.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", TinyModelSpec())
