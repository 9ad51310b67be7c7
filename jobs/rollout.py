"""Job entry: one MPI rank of the rollout role (see sbatch/rollout.sbatch): `rstar-hpc rollout ARGS`; rank 0
schedules, ranks 1.. run vLLM engines."""
import sys

from rstar_hpc.cli import main

if __name__ == "__main__":
    main(["rollout", *sys.argv[1:]])
