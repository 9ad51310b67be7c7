"""Job entry: sample from the policy in vLLM on a rollout node (see sbatch/generate.sbatch)."""
from rstar_hpc.cli import main

if __name__ == "__main__":
    import sys

    main(["generate", *sys.argv[1:]])
