"""An interrupted test session stops within seconds and leaves no daemon behind. `make test` itself (its pytest, two
xdist workers) runs a one-test file that holds the session's `slurm_cluster` with a job running on it, and is
stopped as a CI runner or a terminal stops it: SIGINT to make alone (make passes it to nobody), SIGTERM to make alone
(make passes it to pytest alone), or Ctrl-C (SIGINT to the whole process group). The fixture's own teardown must take
the cluster down: its state folder gone, and no process left whose command line or environment names it (munged,
slurmctld, slurmscriptd, the slurmds, the job's slurmstepd and its task)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
STOP_WITHIN_S = 20.0

HOLD = '''
import os, subprocess, time
from pathlib import Path


def test_hold(slurm_cluster):
    out = subprocess.run(["sbatch", "--parsable", "-p", "cpu", "-o", "/dev/null", "--wrap", "sleep 600"],
                         env=slurm_cluster.env, capture_output=True, text=True, check=True)
    job = out.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 30
    while subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=slurm_cluster.env, capture_output=True,
                         text=True).stdout.strip() != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.2)
    Path(os.environ["HOLD_MARKER"]).write_text(str(slurm_cluster.dir))
    time.sleep(600)
'''


def _processes_naming(text: str) -> list[str]:
    found, key = [], text.encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline, environ = (proc / "cmdline").read_bytes(), (proc / "environ").read_bytes()
        except OSError:
            continue
        if key in cmdline or key in environ:
            args = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{proc.name} {args[:200]}")
    return found


def _clean_up(state: str) -> None:
    """What a failed run left: the cluster down, its processes killed, its folder gone."""
    from rstar_hpc.cluster import LocalCluster

    LocalCluster(state).down(timeout_s=5)
    for line in _processes_naming(state):
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except OSError:
            pass
    shutil.rmtree(state, ignore_errors=True)


@pytest.mark.parametrize("how", ["SIGINT to make", "SIGTERM to make", "Ctrl-C"])
def test_an_interrupted_session_takes_its_clusters_down(tmp_path, how):
    (tmp_path / "test_hold.py").write_text(HOLD)
    marker, log = tmp_path / "cluster-dir", tmp_path / "make.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(HOLD_MARKER=str(marker),
               PYTEST_ADDOPTS=f"-p tests.conftest -p no:cacheprovider {tmp_path / 'test_hold.py'}")
    # `make test` as CI runs it, less its set-up (done), with this interpreter's environment
    argv = ["make", "-s", "-C", str(REPO), "-o", "setup", f"VENV={sys.prefix}", "test"]
    with open(log, "w") as out:
        make = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    state = None
    try:
        deadline = time.monotonic() + 90
        while not marker.exists() and make.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), f"the cluster never came up (make: {make.poll()}):\n{log.read_text()[-4000:]}"
        state = marker.read_text()
        assert _processes_naming(state)
        t0 = time.monotonic()
        if how == "Ctrl-C":
            os.killpg(make.pid, signal.SIGINT)
        else:
            make.send_signal(signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGINT)
        try:
            make.wait(STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{how}: still running {STOP_WITHIN_S:.0f} s later:\n{log.read_text()[-4000:]}")
        took = time.monotonic() - t0
        print(f"{how}: make ended {took:.1f} s after the signal")
        left, tail = _processes_naming(state), log.read_text()[-3000:]
        assert not left, f"{how}: stopped in {took:.1f} s, leaving:\n" + "\n".join(left) + "\n" + tail
        assert not Path(state).exists(), f"{how}: the cluster fixture's teardown did not run:\n{tail}"
        assert make.returncode != 0 and "KeyboardInterrupt" in log.read_text()
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()
        if state:
            _clean_up(state)
