"""The trainer's heartbeat while a step trains: beat while it makes progress, fall silent when it does not.

The launcher takes a role for hung when its heartbeat (RUN/heartbeat/trainer.json) is older than
`launch.hang_timeout_s`. The loop beats between phases, but one RL step of a large model (generation's long tail
aside, thousands of micro-batches at a low MFU) can train for longer than that. So rank 0 runs a `ProgressBeat`: a
thread that, every `every_s` (trainer.heartbeat_s), beats if micro-batches were run forward since its last look (step.PROGRESS, counted
in the schedule's forward step, the pi_old recompute included) and says nothing otherwise. A step that moves is
never killed as hung; one that stops moving (a stuck collective, a dead peer, a stopped process) falls silent and
is, after the hang timeout, as before.

Start-up is progress too: rank 0 beats as it enters each phase of its start (`starting`: imports, torch.distributed,
the model and optimizer, their weights, the stage's data, the first step), so a start longer than the hang timeout
is no hang while its phases advance, and one phase stuck for the hang timeout is.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from rstar_hpc.exchange.rundir import RunPaths
from rstar_hpc.exchange.state import write_heartbeat

log = logging.getLogger("rstar_hpc.trainer")


def starting(paths: RunPaths, stage: str, doing: str, rank0: bool = True) -> None:
    """Rank 0 enters a phase of its start: the heartbeat says which (phase "start")."""
    if rank0:
        try:
            write_heartbeat(paths, "trainer", f"stage {stage}: starting: {doing}", stage=stage, phase="start")
        except OSError as e:
            log.warning("trainer heartbeat not written: %s", e)


class ProgressBeat:
    """`doing()` says what the step is (e.g. "stage rl: training step 12"); the beat adds how far it got."""

    def __init__(self, paths: RunPaths, doing: Callable[[], str], stage: str, every_s: float = 30.0):
        from rstar_hpc.trainer.step import PROGRESS   # torch: `starting` beats before the trainer imports it

        self.progress = PROGRESS
        self.paths, self.doing, self.stage, self.every_s = paths, doing, stage, every_s
        self._stop = threading.Event()
        self._seen = self.progress.micro_batches
        self._thread = threading.Thread(target=self._run, name="trainer-progress-beat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            now = self.progress.micro_batches
            if now == self._seen:
                continue   # no progress: stay silent, so a stuck step goes stale
            self._seen = now
            try:
                write_heartbeat(self.paths, "trainer", f"{self.doing()}: {now} micro-batches run so far",
                                stage=self.stage, phase="train", micro_batches=now)
            except OSError as e:   # a full disk or a storage hiccup: the loop's own writes will say it
                log.warning("trainer heartbeat not written: %s", e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
