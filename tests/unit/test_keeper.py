"""The rollout's keeper (rollout/keeper.py) on stand-in ranks: an engine rank that dies is reported to rank 0 and
started again up to launch.rollout.engine_restarts times, then given up on; the other engine is never touched;
rank 0's end stops every engine and what it started, and nothing starts again."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from rstar_hpc.exchange.events import read_events
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.rollout.keeper import Keeper

pytestmark = pytest.mark.skipif(shutil.which("ompi-server") is None, reason="needs Open MPI's ompi-server")

# A stand-in rank: appends "rank pid" to starts.txt, then acts out its part of the scenario (argv[2]).
RANK = r'''
import json, os, subprocess, sys, time
from pathlib import Path
out, scenario = Path(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RSTAR_ROLLOUT_RANK"])
session = Path(os.environ["RSTAR_RUN_DIR"]) / "rendezvous" / "rollout" / os.environ["RSTAR_ROLLOUT_SESSION"]
with open(out / "starts.txt", "a") as f:
    f.write(f"{rank} {os.getpid()}\n")
assert "SLURM_NODELIST" not in os.environ and "OMPI_MCA_pmix_server_uri" in os.environ
if rank == 0:
    if scenario == "rank0_dies":
        time.sleep(1.0)
        os.kill(os.getpid(), 9)
    # rank 0 waits until the keeper has given engine 1 up (its report says restarts 2), then leaves
    report = session / "engine-1.json"
    deadline = time.time() + 60
    while time.time() < deadline:
        if report.exists() and json.loads(report.read_text())["restarts"] == 2:
            break
        time.sleep(0.05)
    sys.exit(0)
if rank == 1 and scenario == "engine_dies":
    time.sleep(0.3)
    sys.exit(3)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])   # like vLLM's engine core
with open(out / "children.txt", "a") as f:
    f.write(f"{child.pid}\n")
time.sleep(300)
'''


def _keeper(tmp_path, scenario: str, restarts: int = 2) -> tuple[int, RunPaths]:
    paths = RunPaths(tmp_path / "run")
    paths.create()
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "RSTAR_RUN_DIR": str(paths.dir), "SLURM_NODELIST": "gpu1"}
    keeper = Keeper(paths, [sys.executable, str(script), str(tmp_path), scenario], [0, 1, 2], 3, "t",
                    engine_restarts=restarts, env=env)
    return keeper.run(), paths


def _starts(tmp_path) -> list[tuple[int, int]]:
    return [tuple(map(int, line.split())) for line in (tmp_path / "starts.txt").read_text().splitlines()]


def _children(tmp_path) -> list[int]:
    path = tmp_path / "children.txt"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(out) and not out.startswith("Z")


def test_a_dying_engine_is_started_again_then_given_up_and_the_others_are_untouched(tmp_path):
    t0 = time.monotonic()
    code, paths = _keeper(tmp_path, "engine_dies")
    starts = _starts(tmp_path)
    assert code == 0
    assert [r for r, _ in starts].count(1) == 3    # the first start and 2 restarts
    assert [r for r, _ in starts].count(2) == 1    # the other engine: one process throughout
    events = [e for e in read_events(paths) if e["kind"] == "engine_gave_up"]
    assert [(e["rank"], e["restarts"], e["limit"], e["exit"]) for e in events] == [(1, 2, 2, "exit 3")]
    left = [p.name for p in (paths.rendezvous_dir("rollout") / "t").iterdir()]
    assert left == ["over"], left   # the session's files go with the job, but the word that rank 0 has left
    # rank 0's end stopped engine 2 and what it had started, after the grace time, not the engine's 300 s
    assert _children(tmp_path) and not any(_alive(pid) for pid in [p for _, p in starts] + _children(tmp_path))
    assert time.monotonic() - t0 < 60


def test_rank_0s_death_stops_every_engine_and_starts_nothing(tmp_path):
    code, paths = _keeper(tmp_path, "rank0_dies")
    starts = _starts(tmp_path)
    assert code == -signal.SIGKILL
    assert sorted(r for r, _ in starts) == [0, 1, 2]   # nothing started again
    assert not any(_alive(pid) for pid in [p for _, p in starts] + _children(tmp_path))
    assert not [e for e in read_events(paths) if e["kind"].startswith("engine_")]
