"""Job entry: one MPI rank of the rollout role (see sbatch/rollout.sbatch); rank 0 schedules, ranks 1.. run
vLLM engines."""
from rstar_hpc.rollout.job import main

if __name__ == "__main__":
    main()
