"""Launching jobs: the sbatch templates in sbatch/ and the Slurm commands that start and watch them."""
from rstar_hpc.launch.slurm import JobFailed, job_state, submit, wait_for_job

__all__ = ["JobFailed", "job_state", "submit", "wait_for_job"]
