"""Job entry: the sandbox service on one CPU node (see sbatch/sandbox.sbatch): `rstar-hpc sandbox serve ARGS`.

Named sandbox_service.py, not sandbox.py: a script's own directory heads sys.path, so a jobs/sandbox.py would
shadow the `sandbox` package it starts.
"""
import sys

from rstar_hpc.cli import main

if __name__ == "__main__":
    main(["sandbox", "serve", *sys.argv[1:]])
