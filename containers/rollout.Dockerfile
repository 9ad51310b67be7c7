# rstar-hpc rollout image: vLLM's own image (the CUDA vLLM pins its own torch), with Open MPI for the rollout's ranks
# and rstar-hpc's wheel on top. Nothing compiles: vLLM and torch are kept as the base ships them.
#
#   pip wheel --no-deps -w dist .                       # in a checkout: dist/rstar_hpc-0.1.0-py3-none-any.whl
#   docker build -f containers/rollout.Dockerfile -t rstar-hpc-rollout:0.1.0 .
#   enroot import -o /lustre/images/rstar-rollout.sqsh dockerd://rstar-hpc-rollout:0.1.0     # pyxis
#   launch.rollout.container: {image: /lustre/images/rstar-rollout.sqsh}
#
# Under srun --mpi=pmix (launch.mpi) the image's Open MPI must speak the site's PMIx; where it does not, use
# launch.mpi=none (one rollout node: the role starts its own mpirun inside the image).
ARG BASE=vllm/vllm-openai:v0.32.0
FROM ${BASE}
ARG WHEEL=dist/rstar_hpc-0.1.0-py3-none-any.whl
RUN apt-get update && apt-get install -y --no-install-recommends openmpi-bin libopenmpi-dev bubblewrap \
 && rm -rf /var/lib/apt/lists/*
COPY ${WHEEL} /tmp/
RUN python3 -m pip freeze | grep -iE '^(torch|vllm|xformers|flashinfer[^=]*|triton|nvidia-[^=]*)==' > /tmp/keep.txt \
 && python3 -m pip install --no-cache-dir --constraint /tmp/keep.txt /tmp/$(basename ${WHEEL}) \
 && rm /tmp/*.whl /tmp/keep.txt \
 && python3 -c "import rstar_hpc, vllm, mpi4py"
ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 OMPI_MCA_plm=^slurm
ENTRYPOINT []
CMD ["rstar-hpc", "--help"]
