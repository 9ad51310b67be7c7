"""rstar-hpc: rStar2-Agent as a Slurm-native batch-job suite."""
__version__ = "0.1.0"
