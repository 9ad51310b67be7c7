"""Errors of the exchange; each message names the path involved and what to do about it."""
from __future__ import annotations


class ExchangeError(RuntimeError):
    """Base class: something in the run directory is not as the protocol requires."""


class CorruptShardError(ExchangeError):
    """A committed shard's size or checksum differs from its commit record (torn write, bit rot, tampering)."""

    def __init__(self, path: str, reason: str):
        self.path = path
        super().__init__(
            f"corrupt trajectory shard {path}: {reason}. The commit record lists a different file; "
            f"delete the step's commit record of that producer and re-run it (or drop the step).")


class StepNotReadyError(ExchangeError, TimeoutError):
    """Not every expected producer committed the step in time."""

    def __init__(self, step_dir: str, step: int, missing: list[str], committed: list[str], waited_s: float):
        self.step, self.missing, self.committed = step, missing, committed
        super().__init__(
            f"step {step} not complete after {waited_s:.1f}s in {step_dir}: missing producers {missing} "
            f"(committed: {committed or 'none'}). Check those rollout ranks' logs and announcements "
            f"(`rstar-hpc run status`).")
