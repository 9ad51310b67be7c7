"""Exit codes of `rstar-hpc`, in one place."""
EXIT_OK = 0
EXIT_FAILED = 1      # the verb ran and what it checked or ran failed (doctor: a failed check)
EXIT_USAGE = 2       # bad command line (click's convention)
EXIT_CONFIG = 3      # the config is invalid; the message names the key
EXIT_NOT_FOUND = 4   # a path the command needs (model, run directory) does not exist
