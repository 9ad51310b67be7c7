"""A trainer killed with SIGKILL leaves no helper process behind: megatron's checkpoint writer's results queue lives on
a manager server that dies with it (rstar_hpc/trainer/orphans.py). Without it, the manager and multiprocessing's
resource tracker outlive the trainer, reparented to init, and escape proctrack/linuxproc (docs/reliability.md)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.procfs import running

REPO = Path(__file__).resolve().parents[2]
TRAINER = r"""
import sys, time
from megatron.core.dist_checkpointing.strategies import filesystem_async
if sys.argv[1] == "ours":
    from rstar_hpc.trainer.orphans import results_queue_dies_with_trainer
    results_queue_dies_with_trainer()
    results_queue_dies_with_trainer()   # once
queue = filesystem_async._get_write_results_queue()   # what megatron's writer calls at a rank's first save
queue.put("written")
assert queue.get() == "written"
print("saved", flush=True)
time.sleep(600)
"""


def _children(pid: int) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(proc.name))
        except (OSError, IndexError, ValueError):
            pass
    return out


def _left_after_kill_9(mode: str) -> tuple[list[int], list[int]]:
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, mode], stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "saved"
    helpers = _children(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 20
    while any(running(p) for p in helpers) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in helpers if running(p)]
    for pid in left:   # the test's own leak (megatron's default): end it
        os.kill(pid, signal.SIGKILL)
    return helpers, left


def test_megatrons_writer_helpers_die_with_a_killed_trainer():
    helpers, left = _left_after_kill_9("ours")
    assert len(helpers) == 2 and left == [], (helpers, left)   # the manager and the resource tracker, both gone


def test_without_it_they_outlive_the_trainer():
    """The fault the fix is for, so that the test above means something: megatron's own queue leaves both."""
    helpers, left = _left_after_kill_9("megatron")
    assert len(helpers) == 2 and left == helpers, (helpers, left)
