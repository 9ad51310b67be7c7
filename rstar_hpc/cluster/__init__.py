"""The emulated local Slurm cluster (development, tests, the demo). Real clusters need none of this."""
from rstar_hpc.cluster.local import ClusterError, ClusterSpec, LocalCluster, default_state_dir

__all__ = ["ClusterError", "ClusterSpec", "LocalCluster", "default_state_dir"]
