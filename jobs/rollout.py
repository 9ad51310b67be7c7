"""Job entry: the rollout role (see sbatch/rollout.sbatch): `rstar-hpc rollout ARGS`, the keeper of its ranks; rank 0
schedules, ranks 1.. run vLLM engines."""
import sys

from rstar_hpc.cli import main

if __name__ == "__main__":
    main(["rollout", *sys.argv[1:]])
