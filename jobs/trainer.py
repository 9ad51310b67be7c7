"""Job entry: one trainer rank (see sbatch/trainer.sbatch): `rstar-hpc train ARGS`.

Ranks come from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (srun) or RANK / WORLD_SIZE (torchrun); no launcher
wrapper is needed. After a save on USR2 every rank exits 0; the sbatch script, which sent the USR2, requeues.
"""
import sys

from rstar_hpc.cli import main

if __name__ == "__main__":
    main(["train", *sys.argv[1:]])
