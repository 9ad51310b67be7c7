-- Lmod module for rstar-hpc. Install rstar-hpc into a prefix (a venv on shared storage):
--   python3 -m venv /opt/rstar-hpc/0.1.0 && /opt/rstar-hpc/0.1.0/bin/pip install 'rstar_hpc-0.1.0-py3-none-any.whl[gpu]'
-- then copy this file into a MODULEPATH entry as rstar-hpc/0.1.0.lua, set `prefix` below, and `module load rstar-hpc`.
help([[
rstar-hpc: rStar2-Agent (agentic RL with GRPO-RoC) as Slurm batch jobs.
Puts the install's `rstar-hpc` and `python3` on PATH and sets the variables it reads:
  RSTAR_HPC_CONFIGS   the site's own configs, looked up after ./configs and before the packaged ones
  RSTAR_HPC_RUN_ROOT  where run directories go: set to a shared file system (Lustre/NFS/GPFS)
  HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE, HF_DATASETS_OFFLINE = 1: compute nodes have no internet
]])
whatis("Name: rstar-hpc")
whatis("Description: rStar2-Agent reproduction as a Slurm-native batch-job suite")

local prefix = os.getenv("RSTAR_HPC_PREFIX") or "/opt/rstar-hpc/0.1.0"   -- site: edit to the install prefix
local scratch = os.getenv("SCRATCH") or pathJoin(os.getenv("HOME"), "scratch")

prepend_path("PATH", pathJoin(prefix, "bin"))
setenv("RSTAR_HPC_CONFIGS", pathJoin(prefix, "etc", "rstar-hpc", "configs"))
setenv("RSTAR_HPC_RUN_ROOT", os.getenv("RSTAR_HPC_RUN_ROOT") or pathJoin(scratch, "rstar-hpc", "runs"))
setenv("HF_HUB_OFFLINE", "1")
setenv("TRANSFORMERS_OFFLINE", "1")
setenv("HF_DATASETS_OFFLINE", "1")
-- Sites usually provide these; uncomment to load them with rstar-hpc.
-- depends_on("openmpi")
-- depends_on("slurm")
