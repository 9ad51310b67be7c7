#!/usr/bin/env bash
# Installs the Debian packages rstar-hpc drives for real: bubblewrap (sandbox), Slurm + munge
# (the emulated cluster; iproute2 for its nodes as hosts), OpenMPI (rollout ranks). A no-op, in well under a second, once they are there.
set -euo pipefail
need=()
command -v bwrap     >/dev/null || need+=(bubblewrap)
command -v slurmctld >/dev/null || need+=(slurmctld)
command -v slurmd    >/dev/null || need+=(slurmd)
command -v sbatch    >/dev/null || need+=(slurm-client)
command -v munged    >/dev/null || need+=(munge)
command -v mpirun    >/dev/null || need+=(openmpi-bin)
[ -e /usr/include/x86_64-linux-gnu/openmpi/mpi.h ] || [ -e /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] \
    || need+=(libopenmpi-dev)
command -v lsof >/dev/null || need+=(lsof)
command -v ip   >/dev/null || need+=(iproute2)   # the cluster of hosts' namespaces and links (cluster up --hosts)
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" -ne 0 ]; then
    echo "rstar-hpc: missing system packages: ${need[*]}" >&2
    echo "  run as root: apt-get install -y ${need[*]}   (or load your site's modules)" >&2
    exit 1
fi
echo "rstar-hpc: installing system packages: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
