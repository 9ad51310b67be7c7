"""Job entry: one trainer rank (see sbatch/trainer.sbatch); the arguments of `rstar-hpc train`.

Ranks come from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (srun) or RANK / WORLD_SIZE (torchrun); no launcher
wrapper is needed. After a save on USR2 every rank exits 0; the sbatch script, which sent the USR2, requeues.
"""
from rstar_hpc.cli.train import command

if __name__ == "__main__":
    command.main(prog_name="jobs/trainer.py")
