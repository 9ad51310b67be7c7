"""Job entry: one trainer rank (see sbatch/trainer.sbatch); the arguments of `rstar-hpc train`.

Ranks come from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (srun) or RANK / WORLD_SIZE (torchrun); no launcher
wrapper is needed. Exit 75 means: saved on USR2, requeue the job.
"""
from rstar_hpc.cli.train import command

if __name__ == "__main__":
    command.main(prog_name="jobs/trainer.py")
