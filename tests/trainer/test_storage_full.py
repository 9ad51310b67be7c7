"""The trainer's checkpoint and policy writes on a file system that fills up (a real tmpfs, a real ENOSPC): each fails
with StorageError naming the path and the free space, leaves `latest` on the last complete commit and no
half-written directory, and succeeds once space is freed."""
from __future__ import annotations

import errno
import os

import pytest
import torch
from tests.helpers.storage_fault import fill, small_fs
from tests.helpers.trainer import make_optimizer, make_policy

from rstar_hpc.exchange.errors import StorageError
from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.trainer.checkpoint import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint
from rstar_hpc.trainer.publish import publish_policy
from rstar_hpc.trainer.step import build_scheduler


@pytest.fixture
def fs(tmp_path):
    with small_fs(tmp_path / "fs", "16m") as mnt:
        yield mnt


def _visible(folder) -> list[str]:
    return sorted(os.listdir(folder))


def test_checkpoint_and_policy_on_a_full_disk(dist1, tiny_hf_dir, fs):
    model = make_policy(tiny_hf_dir)
    opt = make_optimizer(model, lr=1e-2)
    state = TrainState(model, opt, build_scheduler(opt, 1, 10, "cosine"), step=1, data_state={"next_traj_step": 1})
    root = fs / "run" / "ckpt" / "rl"
    first = save_checkpoint(state, root)
    size = sum(p.stat().st_size for p in first.rglob("*") if p.is_file())

    state.step, state.data_state = 2, {"next_traj_step": 2}
    # wherever the space runs out, a StorageError: torch's zip writer reports a short write without its errno
    for tenths in (1, 3, 7, 9):
        ballast = fill(fs, leave=size * tenths // 10)
        with pytest.raises(StorageError) as err:
            save_checkpoint(state, root)
        assert err.value.errno == errno.ENOSPC and _visible(root) == ["latest", "step-00000001"], tenths
        ballast.unlink()
    ballast = fill(fs, leave=size // 2)   # half a checkpoint's room
    with pytest.raises(StorageError) as err:
        save_checkpoint(state, root)
    msg = str(err.value)
    assert str(root) in err.value.path and ".step-00000002.tmp-" in err.value.path
    assert "cannot write checkpoint" in msg and "No space left on device" in msg and "free of 16.0 MiB" in msg, msg
    assert _visible(root) == ["latest", "step-00000001"]   # no half-written directory, not even a hidden one
    assert latest_checkpoint(root) == first

    paths = RunPaths(fs / "run")
    with pytest.raises(StorageError) as err:
        publish_policy(model, paths, source_dir=tiny_hf_dir, keep_last=2, stage="rl", trainer_step=2)
    assert ".v-00000001.tmp-" in err.value.path and "cannot write policy" in str(err.value)
    assert paths.policies().latest() is None and _visible(paths.policies().root) == []

    ballast.unlink()   # space freed: the same writes go through, each committed once
    assert save_checkpoint(state, root) == root / "step-00000002" and latest_checkpoint(root) == root / "step-00000002"
    assert _visible(root) == ["latest", "step-00000001", "step-00000002"]
    version, out = publish_policy(model, paths, source_dir=tiny_hf_dir, keep_last=2, stage="rl", trainer_step=2)
    assert version == 1 and paths.policies().latest() == (1, out) and _visible(paths.policies().root) == [
        "latest", "v-00000001"]

    resumed = TrainState(make_policy(tiny_hf_dir), make_optimizer(make_policy(tiny_hf_dir), lr=1e-2), None)
    load_checkpoint(resumed, root)
    assert resumed.step == 2 and resumed.data_state == {"next_traj_step": 2}
    for a, b in zip(model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
