"""Exit codes of `rstar-hpc`, in one place, and the errors that carry them."""
import click

EXIT_OK = 0
EXIT_FAILED = 1      # the verb ran and what it checked or ran failed (doctor: a failed check)
EXIT_USAGE = 2       # bad command line (click's convention)
EXIT_CONFIG = 3      # the config is invalid; the message names the key
EXIT_NOT_FOUND = 4   # a path the command needs (model, run directory) does not exist


class NotFound(click.ClickException):
    exit_code = EXIT_NOT_FOUND


def run_paths(run: str):
    """The RunPaths of RUN (a run directory, or a run name under $RSTAR_HPC_RUN_ROOT); NotFound (exit 4) if none."""
    from rstar_hpc.exchange.rundir import RunPaths

    try:
        return RunPaths.resolve(run)
    except FileNotFoundError as e:
        raise NotFound(str(e)) from None
