"""How a test session takes a stop signal (tests/helpers/interrupts.py), in processes of their own, without a cluster:
the first signal interrupts, repeats wait for the teardown until the grace runs out, a teardown inside `deferred()`
runs to its end, a forked child keeps the old disposition, and a SIGINT that make takes reaches its pytest. The whole
path, `make test` with an emulated cluster, is tests/integration/test_suite_interrupt.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRELUDE = "import os, signal, sys, time\nfrom tests.helpers import interrupts\ninterrupts.install()\n"


def _run(code: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + code], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_the_first_signal_interrupts_and_a_repeat_lets_the_teardown_finish():
    done = _run("try:\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(10)\n    print('slept on')\n"
                "except KeyboardInterrupt as e:\n    print('interrupted by', e)\n"
                "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(0.2)\nprint('teardown done')\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["interrupted by SIGTERM", "teardown done"]
    assert "SIGINT again" in done.stderr


def test_a_repeat_after_the_grace_forces():
    done = _run("interrupts.GRACE_S = 0\ntry:\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(10)\n"
                "except KeyboardInterrupt:\n    pass\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(10)\n")
    assert done.returncode == -signal.SIGTERM and "forced" in done.stderr


def test_a_signal_inside_deferred_waits_for_its_end():
    done = _run("try:\n    with interrupts.deferred():\n        os.kill(os.getpid(), signal.SIGHUP)\n"
                "        time.sleep(0.2)\n        print('cluster down')\n"
                "except KeyboardInterrupt:\n    print('stopped')\n")
    assert done.stdout.split() == ["cluster", "down", "stopped"], done.stderr


def test_a_signal_in_the_final_teardown_lets_it_finish():
    done = _run("interrupts.finishing()\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(0.2)\nprint('finished')\n")
    assert done.returncode == 0 and done.stdout == "finished\n", done.stderr


def test_a_forked_child_keeps_the_disposition_it_had():
    done = _run("pid = os.fork()\nif pid == 0:\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(10)\n"
                "    os._exit(0)\nprint(os.waitpid(pid, 0)[1] & 0x7f)\n")
    assert done.stdout.strip() == str(int(signal.SIGTERM)), done.stderr


def test_a_sigint_that_make_takes_reaches_its_pytest(tmp_path):
    """make passes SIGINT to nobody and waits for its child: the child sees make drop its handler."""
    (tmp_path / "child.py").write_text(
        PRELUDE + "interrupts.watch_make(0.1)\nprint('started', flush=True)\ntry:\n    time.sleep(30)\n"
        "except KeyboardInterrupt:\n    print('interrupted', flush=True)\n    sys.exit(3)\n")
    (tmp_path / "Makefile").write_text(f"t:\n\t{sys.executable} {tmp_path / 'child.py'}\n")
    log = tmp_path / "make.log"
    with open(log, "w") as out:
        make = subprocess.Popen(["make", "-s", "-C", str(tmp_path), "t"], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 30
        while "started" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        make.send_signal(signal.SIGINT)
        assert make.wait(10) == -signal.SIGINT
        assert "interrupted" in log.read_text()
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)


def test_a_session_is_dead_when_its_scratch_is_gone_or_its_owner_died(tmp_path):
    from tests.helpers import interrupts

    live, dead, unclaimed = (tmp_path / f"{interrupts.SCRATCH_PREFIX}{n}" for n in ("live", "dead", "unclaimed"))
    for d in (live, dead, unclaimed):
        d.mkdir()
    interrupts.claim(str(live))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (dead / interrupts.OWNER).write_text(f"{gone.pid} 1\n")
    assert not interrupts._dead_session(str(live))
    assert interrupts._dead_session(str(dead))
    assert interrupts._dead_session(str(tmp_path / f"{interrupts.SCRATCH_PREFIX}removed"))
    assert not interrupts._dead_session(str(unclaimed))   # a session of a tree without owner files: left alone
    assert not interrupts._dead_session(str(tmp_path))    # not a session's scratch at all
