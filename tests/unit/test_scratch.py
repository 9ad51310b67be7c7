"""rstar_hpc/scratch.py: a command's scratch goes under $TMPDIR and is gone when the command ends, whether it ends
normally, fails or is terminated; --keep keeps it and says where; torch's kernel cache is a process's own."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rstar_hpc.scratch import TORCH_CACHE_OWNER, scratch_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def tmpdir_env(tmp_path, monkeypatch) -> Path:
    """tempfile's default directory (what $TMPDIR sets) pointed at an empty folder for this test."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def test_scratch_is_under_tmpdir_and_gone_after(tmpdir_env):
    with scratch_dir("x-") as d:
        assert d.parent == tmpdir_env and d.name.startswith("x-")
        (d / "f").write_text("data")
    assert list(tmpdir_env.iterdir()) == []


def test_scratch_is_gone_after_a_failure(tmpdir_env):
    with pytest.raises(RuntimeError), scratch_dir("x-") as d:
        (d / "f").write_text("data")
        raise RuntimeError("boom")
    assert list(tmpdir_env.iterdir()) == []


def test_keep_keeps_it_and_says_where(tmpdir_env, capsys):
    with scratch_dir("x-", keep=True) as d:
        (d / "f").write_text("data")
    assert (d / "f").read_text() == "data"
    assert str(d) in capsys.readouterr().err


def test_sigterm_removes_it(tmp_path):
    code = ("import os, signal, sys, time\nfrom rstar_hpc.scratch import scratch_dir\n"
            "with scratch_dir('x-') as d:\n    (d / 'f').write_text('data')\n    print(d, flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(30)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "TMPDIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    assert done.stdout.strip().startswith(str(tmp_path)) and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("inherited", [None, "elsewhere:1"])
def test_torch_kernel_cache_is_the_process_own(tmp_path, inherited):
    """Importing torch._dynamo (megatron-core and vLLM do) makes $TMPDIR/torchinductor_<user>; after
    private_torch_cache() nothing is left. A cache dir inherited from another host's process (sbatch copies the
    login node's environment) is replaced, not used."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env.pop(TORCH_CACHE_OWNER, None)
    if inherited:
        env.update({"TORCHINDUCTOR_CACHE_DIR": "/nonexistent/torchinductor-1", TORCH_CACHE_OWNER: inherited})
    code = ("import os\nfrom rstar_hpc.scratch import private_torch_cache\npath = private_torch_cache()\n"
            "import torch._dynamo\nassert os.path.isdir(path), path\nprint(path)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.strip()).parent == tmp_path
    assert list(tmp_path.iterdir()) == []
