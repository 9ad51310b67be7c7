"""Job entry: sample from the policy in vLLM on a rollout node (see sbatch/generate.sbatch): `rstar-hpc generate
ARGS`."""
import sys

from rstar_hpc.cli import main

if __name__ == "__main__":
    main(["generate", *sys.argv[1:]])
