# rstar-hpc trainer image: Megatron-core on NVIDIA's PyTorch image, which ships torch, Transformer Engine, cuDNN and
# NCCL built together (Transformer Engine's PyTorch extension is published as source only: installing it elsewhere
# compiles it). Nothing compiles here: the base's torch and TE are kept, the wheel and its pure-Python/binary
# dependencies go on top.
#
#   pip wheel --no-deps -w dist .                       # in a checkout: dist/rstar_hpc-0.1.0-py3-none-any.whl
#   docker build -f containers/trainer.Dockerfile -t rstar-hpc-trainer:0.1.0 .
#   enroot import -o /lustre/images/rstar-trainer.sqsh dockerd://rstar-hpc-trainer:0.1.0     # pyxis
#   launch.trainer.container: {image: /lustre/images/rstar-trainer.sqsh}
#
# BASE: an NGC PyTorch release whose Transformer Engine megatron-core 0.16.1 accepts (< 2.12).
ARG BASE=nvcr.io/nvidia/pytorch:25.09-py3
FROM ${BASE}
ARG WHEEL=dist/rstar_hpc-0.1.0-py3-none-any.whl
COPY ${WHEEL} /tmp/
# Keep what the base built together: its torch and TE (and their CUDA libraries) are pinned as they are, so pip
# takes rstar-hpc's other dependencies around them instead of replacing them.
RUN pip freeze | grep -iE '^(torch|transformer[-_]engine[^=]*|nvidia-[^=]*|triton|flash[-_]attn)==' > /tmp/keep.txt \
 && pip install --no-cache-dir --constraint /tmp/keep.txt /tmp/$(basename ${WHEEL}) \
 && rm /tmp/*.whl /tmp/keep.txt \
 && python -c "import rstar_hpc, megatron.core, transformer_engine"
ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
ENTRYPOINT []
CMD ["rstar-hpc", "--help"]
