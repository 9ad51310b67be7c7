"""launch.mpi.start=world: the rollout's ranks as the tasks of one MPI world that srun starts (`--mpi=pmix`), with the
real links (rollout/links.py: WorldLinks on rank 0, EngineLink.world on the engines) and the real tags, on the
cluster of hosts: rank 0 and an engine on one host, another engine on a second host, across the bridge. Under Open
MPI 4.1 (this machine's) and Open MPI 5.0 (the PyPI wheel, `make setup`'s .venv-ompi5), which cannot join separately
started ranks but can do this, and under MPICH 5.0 (the PyPI wheel, .venv-mpich) through `--mpi=pmi2`, its PMI. An
MPI that does not find srun's PMI makes each task a world of one: every rank refuses at once (links.check_world).
One world shares its fate: an engine SIGKILLed ends the step (--kill-on-bad-exit=1,
the role's restart is the supervisor's), every task with it. The ranks leave with MPI_Finalize, as the rollout's do (rollout/mpi.finalize_world): without it the step was
cancelled in 5 of 10 runs here. A few seconds each; no vLLM."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from rstar_hpc.rollout.links import RANK_ENV
from tests.helpers.mpis import mpich_libmpi, needs_mpich, needs_ompi5, ompi5_libmpi

pytestmark = [pytest.mark.slurm]

RANK = r'''
import json, os, signal, socket, sys, time
from rstar_hpc.rollout.links import EngineLink, WorldLinks
from rstar_hpc.rollout.mpi import TAG_RESULT, TAG_WORK, finalize_world, init_mpi
MPI = init_mpi()
me = MPI.COMM_WORLD.Get_rank()
where = {"rank": me, "host": socket.gethostname(), "netns": os.readlink("/proc/self/ns/net"), "pid": os.getpid()}
if me == 0:
    comm = WorldLinks(MPI)
    assert comm.wait_joined(1) == [] and comm.down() == set()
    for r in range(1, comm.Get_size()):
        comm.send("ping", dest=r, tag=TAG_WORK)
    answers, st = [where], MPI.Status()
    deadline = time.monotonic() + 60
    while len(answers) < comm.Get_size() and time.monotonic() < deadline:
        if comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_RESULT, status=st):
            answers.append(comm.recv(source=st.Get_source(), tag=TAG_RESULT))
    print("ANSWERS " + json.dumps({"version": MPI.Get_library_version().splitlines()[0], "answers": answers}),
          flush=True)
    if sys.argv[1] == "kill":
        os.kill(answers[-1]["pid"], signal.SIGKILL)
        time.sleep(60)   # srun ends the world, this rank too
else:
    comm = EngineLink.world(MPI)
    assert comm.recv(source=0, tag=TAG_WORK) == "ping" and comm.Get_rank() == me
    comm.send(where, dest=0, tag=TAG_RESULT)
    comm.flush(10)
    if sys.argv[1] == "kill":
        time.sleep(60)
finalize_world(0)   # as the rollout's ranks leave: Slurm's pmix plugin cancels the step of a rank that does not
os._exit(0)
'''


def _world(cluster, tmp_path, how: str, env_extra: dict, plugin: str = "pmix"
           ) -> tuple[subprocess.CompletedProcess, dict | None]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**cluster.env, **env_extra, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop(RANK_ENV, None)
    # the placement a rollout of two nodes gets: rank 0 and engine 1 on the first node, engine 2 on the second
    proc = subprocess.run(["srun", "-p", "gpu", f"--mpi={plugin}", "--kill-on-bad-exit=1", "-N2", "-n3",
                           "--distribution=block", "--ntasks-per-node=2", "--overcommit", sys.executable,
                           str(script), how], env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ANSWERS ")), None)
    return proc, json.loads(line[len("ANSWERS "):]) if line else None


def _check_answers(got: dict | None, proc, version: str) -> None:
    assert got is not None, f"rank 0 heard nothing (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert got["version"].startswith(version)
    by_rank = {a["rank"]: a for a in got["answers"]}
    assert sorted(by_rank) == [0, 1, 2]
    assert by_rank[0]["host"] == by_rank[1]["host"] != by_rank[2]["host"]
    assert by_rank[0]["netns"] == by_rank[1]["netns"] != by_rank[2]["netns"]   # engine 2 answered across the bridge


def _ompi5_env() -> dict:
    lib = ompi5_libmpi()
    return {"MPI4PY_LIBMPI": str(lib), "OPAL_PREFIX": str(lib.parents[1])}


def _mpich_env() -> dict:
    return {"MPI4PY_LIBMPI": str(mpich_libmpi())}


@pytest.mark.parametrize("mpi", ["ompi4", pytest.param("ompi5", marks=needs_ompi5),
                                 pytest.param("mpich", marks=needs_mpich)])
def test_one_world_across_hosts_speaks_the_rollouts_tags(hosts_cluster, tmp_path, mpi):
    env, plugin, version = {"ompi4": ({}, "pmix", "Open MPI v4."), "ompi5": (_ompi5_env(), "pmix", "Open MPI v5."),
                            "mpich": (_mpich_env(), "pmi2", "MPICH Version:")}[mpi]
    proc, got = _world(hosts_cluster, tmp_path, "talk", env, plugin)
    _check_answers(got, proc, version)
    assert proc.returncode == 0, proc.stderr[-3000:]


@needs_ompi5
def test_a_world_srun_did_not_start_is_refused_by_every_rank(hosts_cluster, tmp_path):
    """Open MPI 5 under srun --mpi=pmi2: no PMIx server, so each task is a singleton, rank 0 of a world of one."""
    proc, got = _world(hosts_cluster, tmp_path, "talk", _ompi5_env(), "pmi2")
    assert got is None and proc.returncode != 0, proc.stdout[-2000:]
    said = r"srun started 3 rollout tasks, but this one \(task \d\) is rank 0 of an MPI world of 1: Open MPI v5\.0\.\d+ " \
           r"did not find srun's PMI \(srun --mpi=<launch.mpi.plugin>\)"
    assert re.search(said, proc.stderr), proc.stderr[-3000:]


@needs_ompi5
def test_an_engine_killed_ends_the_world_and_leaves_no_task(hosts_cluster, tmp_path):
    proc, got = _world(hosts_cluster, tmp_path, "kill", _ompi5_env())
    _check_answers(got, proc, "Open MPI v5.")
    assert proc.returncode != 0   # the step failed: the supervisor starts the role again
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "rank.py")], capture_output=True, text=True).stdout.split()
    assert left == []
