#!/usr/bin/env bash
# The trainer on one GPU with no internet, in a few minutes: SFT and RL steps of a randomly initialised Qwen3
# (qwen3-0.6b's shape) in bf16, packed, with and without recompute; the last line is one JSON object of tokens/s,
# MFU, peak memory and `trainer plan`'s prediction (scripts/gpu_check.py), also written to docs/gpu-figures/ on a GPU
# (commit those: the planner's per-card MFU; figures discussed in docs/gpu-trainer.md).
#
#   scripts/gpu-check.sh [--dry] [gpu_check.py options]    # --dry: the same steps on the CPU, tiny shape
#   scripts/gpu-check.sh --fetch-wheels DIR [PYVER]        # where a registry is reachable: the wheels to carry
#
# Beyond PyTorch the check needs megatron-core (pure Python but for one unused helper) and pydantic. When they do
# not import, it installs the wheels in $RSTAR_WHEELS (default ./.whl) with pip --no-index.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
WHEELS=${RSTAR_WHEELS:-.whl}
PINS="megatron-core==0.16.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
      typing_extensions==4.16.0"

if [ "${1:-}" = "--fetch-wheels" ]; then
    dir=${2:?usage: scripts/gpu-check.sh --fetch-wheels DIR [PYVER]}; pyver=${3:-3.12}
    # shellcheck disable=SC2086
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$dir" $PINS
    exit 0
fi
if ! "$PY" -c "import megatron.core, pydantic, yaml" 2>/dev/null; then
    if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "gpu-check: megatron-core or pydantic does not import and $WHEELS holds no wheels; on a machine with a" \
             "registry run: scripts/gpu-check.sh --fetch-wheels $WHEELS, and bring that folder along" >&2
        exit 2
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$WHEELS"/*.whl
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout 480 "$PY" scripts/gpu_check.py "$@"
