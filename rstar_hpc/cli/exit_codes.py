"""Exit codes of `rstar-hpc`, in one place, and the errors that carry them."""
from __future__ import annotations

import json
import os
import socket
import time
from contextlib import contextmanager

import click

EXIT_OK = 0
EXIT_FAILED = 1      # the verb ran and what it checked or ran failed (doctor: a failed check)
EXIT_USAGE = 2       # bad command line (click's convention)
EXIT_CONFIG = 3      # the config is invalid; the message names the key
EXIT_NOT_FOUND = 4   # a path the command needs (model, run directory) does not exist
# A role refused its config or inputs (model, data): no restart can fix it, so a launcher that sees it stops the
# run's job at once instead of starting the role again. sysexits' EX_CONFIG; apart from 75 (EX_TEMPFAIL: a role
# saved on a signal and asks to be run again), 126/127 (the shell's) and 128+N (a signal's: 137, 143).
EXIT_REFUSED = 78
REFUSED_RUN_ENV = "RSTAR_RUN_DIR"   # set by the launchers for their roles (launch/roles.role_env)


class NotFound(click.ClickException):
    exit_code = EXIT_NOT_FOUND


class Refused(click.ClickException):
    """A role that cannot succeed however often it is started: its config, model or data is wrong. It exits
    EXIT_REFUSED and, under a launcher, leaves RUN/launch/refused-<role>.json: srun reports a task killed by
    --kill-on-bad-exit over the exit code of the rank that refused, so the launcher reads the record too."""

    exit_code = EXIT_REFUSED

    def __init__(self, role: str, message: str):
        super().__init__(message)
        self.role = role

    def show(self, file=None) -> None:
        click.echo(f"rstar-hpc {self.role}: refused: {self.message}\n  no restart can fix this (exit "
                   f"{EXIT_REFUSED}): fix the config or the input named above; `rstar-hpc launch RUN/config.yaml "
                   f"[key=value ...]` then continues the run where it stopped", err=True, file=file)

    def record(self) -> None:
        """The refusal where the role's launcher looks (REFUSED_RUN_ENV names the run); nothing outside one."""
        from rstar_hpc.exchange.atomic import atomic_write_json
        from rstar_hpc.exchange.rundir import RunPaths

        run = os.environ.get(REFUSED_RUN_ENV)
        if not run:
            return
        path = RunPaths(run).refusal(self.role)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, {"role": self.role, "message": self.message, "time": time.time(),
                                     "host": socket.gethostname()})
        except OSError:
            pass   # the exit code still says it


@contextmanager
def refusing(role: str, *also: type[BaseException]):
    """Errors of a role's inputs raised inside (ConfigError: the config and its model; DatasetError: its data; a
    missing file; `also`) become a Refused. Only around reading inputs: an error in a step may be a bug or
    transient, and a restart is its remedy."""
    try:
        yield
    except Exception as e:
        from rstar_hpc.config import ConfigError   # here: `sandbox serve` without a config imports neither
        from rstar_hpc.data.files import DatasetError

        if isinstance(e, (ConfigError, DatasetError, FileNotFoundError, *also)):
            raise Refused(role, str(e)) from e
        raise


def refusal(paths, role: str) -> dict | None:
    """The refusal `role` recorded since the run's latest launch (older ones were before the fix), or None."""
    from rstar_hpc.launch.record import read_record

    try:
        found = json.loads(paths.refusal(role).read_text())
    except (OSError, ValueError):
        return None
    launches = read_record(paths)["launches"]
    return found if found.get("time", 0) >= (launches[-1]["submitted_at"] if launches else 0) else None


def run_paths(run: str):
    """The RunPaths of RUN (a run directory, or a run name under $RSTAR_HPC_RUN_ROOT); NotFound (exit 4) if none."""
    from rstar_hpc.exchange.rundir import RunPaths

    try:
        return RunPaths.resolve(run)
    except FileNotFoundError as e:
        raise NotFound(str(e)) from None
