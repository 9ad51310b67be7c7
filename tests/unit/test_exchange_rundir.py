import os
import stat

import pytest

from rstar_hpc.exchange.checkpoints import CommittedDirs
from rstar_hpc.exchange.errors import ExchangeError
from rstar_hpc.exchange.reader import Consumer
from rstar_hpc.exchange.retention import prune_trajectories
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.state import StageState, read_stage_state, write_stage_state
from rstar_hpc.synthetic.trajectories import make_step
from rstar_hpc.exchange.writer import ShardWriter


def test_layout_is_derived_in_one_place(tmp_path):
    p = RunPaths(tmp_path / "r1")
    assert p.name == "r1"
    assert p.stage_state("rl-8k") == p.dir / "stages/rl-8k/state.json"
    assert p.cursor("rl-8k", "trainer") == p.dir / "stages/rl-8k/cursors/trainer.json"
    assert p.ckpt_root("rl-8k") == p.dir / "ckpt/rl-8k"
    assert p.traj_commit("rl-8k", 12, "rollout-3") == p.dir / "traj/rl-8k/step-00000012/rollout-3.commit.json"
    assert p.announcement("sandbox", "n1") == p.dir / "rendezvous/sandbox/n1.json"
    assert p.metrics("trainer") == p.dir / "metrics/trainer.jsonl"
    with pytest.raises(ValueError, match="stage name '../x'"):
        p.stage_state("../x")
    with pytest.raises(ValueError, match="non-negative int"):
        p.traj_step_dir("rl", -1)


def test_resolve_by_path_or_name(tmp_path, monkeypatch):
    RunPaths(tmp_path / "myrun").create()
    assert RunPaths.resolve(tmp_path / "myrun").dir == tmp_path / "myrun"
    monkeypatch.setenv("RSTAR_HPC_RUN_ROOT", str(tmp_path))
    monkeypatch.chdir(tmp_path.parent)
    assert RunPaths.resolve("myrun").dir == tmp_path / "myrun"
    with pytest.raises(FileNotFoundError, match="RSTAR_HPC_RUN_ROOT"):
        RunPaths.resolve("nope")


def test_striping_uses_lfs_when_present(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "lfs.log"
    fake = bindir / "lfs"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    p = RunPaths(tmp_path / "run")
    applied = p.create()
    calls = log.read_text().splitlines()
    assert f"setstripe -E 64M -c 1 -E -1 -c 4 -S 4M {p.dir / 'ckpt'}" in calls
    assert f"setstripe -c 1 {p.dir / 'traj'}" in calls
    assert len(applied) == 3
    assert p.create() == []          # layouts are inherited at creation: never re-striped


def test_striping_is_a_noop_without_lfs(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert RunPaths(tmp_path / "run").create() == []


def test_stage_state_round_trip_and_moves(tmp_path, monkeypatch):
    p = RunPaths(tmp_path / "run")
    fresh = read_stage_state(p, "rl-8k")
    assert (fresh.status, fresh.step, fresh.data_cursor) == ("PENDING", 0, 0)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    s = read_stage_state(p, "rl-8k").advance("RUNNING", step=5, data_cursor=640, policy_version=5)
    write_stage_state(p, s)
    assert read_stage_state(p, "rl-8k") == s and s.slurm_job_id == "77"
    failed = s.advance("FAILED", message="OOM")
    done = failed.advance("RUNNING").advance("DONE", step=6)
    write_stage_state(p, done)
    assert read_stage_state(p, "rl-8k").status == "DONE"
    with pytest.raises(ExchangeError, match="DONE -> RUNNING"):
        done.advance("RUNNING")
    with pytest.raises(ValueError, match="not one of"):
        StageState("x", status="BROKEN")
    p.stage_state("bad").parent.mkdir(parents=True)
    p.stage_state("bad").write_text("{")
    with pytest.raises(ExchangeError, match="bad/state.json is not valid JSON"):
        read_stage_state(p, "bad")


def _save(store: CommittedDirs, step: int) -> None:
    tmp = store.begin(step)
    (tmp / "model.bin").write_bytes(os.urandom(100))
    store.commit(step, tmp, iteration=step)


def test_latest_moves_only_after_complete_commit(tmp_path):
    store = CommittedDirs(tmp_path / "ckpt", prefix="step")
    assert store.latest() is None
    _save(store, 10)
    assert store.latest() == (10, store.path(10))
    assert store.marker(10)["files"] == {"model.bin": 100} and store.marker(10)["iteration"] == 10
    tmp = store.begin(20)                      # a save killed before its commit
    (tmp / "model.bin").write_bytes(b"partial")
    assert store.latest() == (10, store.path(10)) and store.complete_steps() == [10]
    # a crash after the directory rename but before the pointer moved: `latest` still names step 10 ...
    _save(store, 30)
    store.latest_pointer.write_text("step-00000010\n")
    assert store.latest()[0] == 10
    # ... and a lost or torn pointer falls back to the newest complete directory
    store.latest_pointer.write_text("step-000")
    assert store.latest()[0] == 30
    with pytest.raises(ExchangeError, match="never rewritten"):
        _save(store, 30)


def test_retention_keeps_last_k_and_never_latest(tmp_path):
    store = CommittedDirs(tmp_path / "ckpt")
    for step in (1, 2, 3, 4, 5):
        _save(store, step)
    stale = store.begin(6)
    os.utime(stale, (0, 0))                    # an in-progress dir abandoned long ago
    store.latest_pointer.write_text("step-00000002\n")   # e.g. step 2 is the one resumed from
    removed = store.retain(keep=2)
    assert store.complete_steps() == [2, 4, 5]
    assert stale in removed and not stale.exists()
    with pytest.raises(ValueError, match="keep at least 1"):
        store.retain(0)


def test_trajectory_retention_never_deletes_unconsumed_steps(tmp_path):
    p = RunPaths(tmp_path / "run")
    for step in range(6):
        with ShardWriter(p, "rl", step, "rollout-0") as w:
            w.write(make_step("run", "rl", step, 1, 2, mean_tokens=20))
    assert prune_trajectories(p, "rl", keep=1) == []          # no consumer yet: all still needed
    c = Consumer(p, "rl", "trainer", ["rollout-0"])
    for _ in range(4):
        c.ack(c.wait(timeout_s=1).step)
    assert prune_trajectories(p, "rl", keep=1) == [0, 1, 2, 3]   # step 4, 5 not yet consumed
    assert p.traj_steps("rl") == [4, 5]
    with pytest.raises(ExchangeError, match="expects step 4"):
        c.ack(7)
