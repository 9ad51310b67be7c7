"""Policy versions (exchange/policy_versions.py): the run-global numbering over files and in-memory offers, and
the look-ups by need (what a rollout step may run, what the trainer's weights are made of)."""
from __future__ import annotations

from rstar_hpc.exchange import policy_versions as pv
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.pipeline import PolicyNeed


def _run(tmp_path) -> RunPaths:
    paths = RunPaths(tmp_path / "run")
    paths.create()
    return paths


def _publish(paths: RunPaths, version: int, stage: str, trainer_step: int) -> None:
    dirs = paths.policies()
    dirs.commit(version, dirs.begin(version), stage=stage, trainer_step=trainer_step)


def test_numbering_is_run_global_over_files_and_offers(tmp_path):
    paths = _run(tmp_path)
    assert pv.newest_published(paths) == pv.newest_offered_version(paths.dir) == pv.BASE == 0
    assert pv.next_version(paths) == 1 and pv.read_offered(paths.dir) is None
    _publish(paths, 1, "sft", 4)
    assert pv.newest_published(paths) == 1 and pv.next_version(paths) == 2
    pv.record_offered(paths.dir, 3, "rl", 2)   # offered in memory only: the files have a gap at 2..3
    assert pv.newest_offered_version(paths.dir) == 3 and pv.next_version(paths) == 4
    assert {k: v for k, v in pv.read_offered(paths.dir).items() if k != "time"} == \
        {"version": 3, "stage": "rl", "trainer_step": 2}
    _publish(paths, 5, "rl", 4)
    assert pv.next_version(paths) == 6


def test_look_ups_by_need(tmp_path):
    paths = _run(tmp_path)
    for v, stage, step in ((1, "sft", 20), (2, "rl", 1), (3, "rl", 1), (4, "rl", 3)):
        _publish(paths, v, stage, step)
    # what a step may run: that stage, at the trainer step or later, the newest
    assert [pv.newest_published_for(paths, PolicyNeed("rl", n)) for n in (0, 1, 2, 3, 4)] == [4, 4, 4, 4, None]
    assert pv.newest_published_for(paths, PolicyNeed("sft", 20)) == 1
    offer = {"version": 5, "stage": "rl", "trainer_step": 4}
    assert pv.offered_for(offer, PolicyNeed("rl", 4)) == 5 and pv.offered_for(offer, PolicyNeed("rl", 5)) is None
    assert pv.offered_for(None, PolicyNeed("rl", 1)) is None and pv.offered_for(offer, PolicyNeed("sft", 1)) is None
    # what the weights are made of: exactly that step, the newest if a retrained step made two
    assert [pv.version_made_of(paths, PolicyNeed(*n)) for n in ((None,), ("rl", 1), ("rl", 2), ("rl", 4))] == \
        [0, 3, None, None]
    pv.record_offered(paths.dir, 5, "rl", 4)   # offered in memory only: the record knows it
    assert pv.version_made_of(paths, PolicyNeed("rl", 4)) == 5 and pv.version_made_of(paths, PolicyNeed("rl", 1)) == 3
