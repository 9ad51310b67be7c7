-- Lmod module for rstar-hpc. Install: copy this directory into a MODULEPATH entry and set `root` below to
-- the checkout holding the .venv made by `make demo`/`make test` (or by `pip install -e '.[gpu]'` on a
-- GPU cluster). Then:  module load rstar-hpc
help([[
rstar-hpc: rStar2-Agent (agentic RL with GRPO-RoC) as Slurm batch jobs.
Puts `rstar-hpc` on PATH and sets the variables it reads:
  RSTAR_HPC_ROOT      the checkout (sbatch/ templates, configs/)
  RSTAR_HPC_RUN_ROOT  where run directories go: set to a shared file system (Lustre/NFS/GPFS)
  HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE, HF_DATASETS_OFFLINE = 1: compute nodes have no internet
]])
whatis("Name: rstar-hpc")
whatis("Description: rStar2-Agent reproduction as a Slurm-native batch-job suite")

local root = os.getenv("RSTAR_HPC_ROOT") or "/opt/rstar-hpc"   -- site: edit to the install location
local scratch = os.getenv("SCRATCH") or pathJoin(os.getenv("HOME"), "scratch")

setenv("RSTAR_HPC_ROOT", root)
prepend_path("PATH", pathJoin(root, ".venv", "bin"))
setenv("RSTAR_HPC_RUN_ROOT", os.getenv("RSTAR_HPC_RUN_ROOT") or pathJoin(scratch, "rstar-hpc", "runs"))
setenv("HF_HUB_OFFLINE", "1")
setenv("TRANSFORMERS_OFFLINE", "1")
setenv("HF_DATASETS_OFFLINE", "1")
-- Sites usually provide these; uncomment to load them with rstar-hpc.
-- depends_on("openmpi")
-- depends_on("slurm")
