# rstar-hpc sandbox image: a slim CPU image for the sandbox nodes. The sandbox service never imports torch or vLLM,
# so the wheel goes in without its dependencies and only what the service and the model's code need comes with it:
# SANDBOX_DEPS (tests/unit/test_containers.py checks it covers what `rstar-hpc sandbox serve` imports, and that each
# is a dependency of the wheel).
#
#   pip wheel --no-deps -w dist .                       # in a checkout: dist/rstar_hpc-0.1.0-py3-none-any.whl
#   docker build -f containers/sandbox.Dockerfile -t rstar-hpc-sandbox:0.1.0 .
#   enroot import -o /lustre/images/rstar-sandbox.sqsh dockerd://rstar-hpc-sandbox:0.1.0     # pyxis
#   launch.sandbox.container: {image: /lustre/images/rstar-sandbox.sqsh}
#
# bwrap needs unprivileged user namespaces inside the container too (`rstar-hpc doctor` checks).
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}
ARG WHEEL=dist/rstar_hpc-0.1.0-py3-none-any.whl
ARG SANDBOX_DEPS="click>=8.1 pydantic>=2.7,<3 PyYAML>=6.0 uvloop>=0.19 numpy>=1.26 sympy>=1.12"
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap \
 && rm -rf /var/lib/apt/lists/*
COPY ${WHEEL} /tmp/
RUN pip install --no-cache-dir ${SANDBOX_DEPS} \
 && pip install --no-cache-dir --no-deps /tmp/$(basename ${WHEEL}) \
 && rm /tmp/*.whl \
 && python -c "import rstar_hpc.cli.sandbox, sandbox.server, numpy, sympy" \
 && python -c "import sys, sandbox.server; assert 'torch' not in sys.modules"
ENV PYTHONUNBUFFERED=1
ENTRYPOINT []
CMD ["python", "-m", "rstar_hpc", "sandbox", "serve", "--help"]
