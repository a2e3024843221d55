#!/usr/bin/env bash
# A separate virtual environment for compiling tacl_jax programs for GPUs on a machine without one
# (deviceless AOT: tacl_jax.topology's 'h100x8'). It holds jax with the CUDA PJRT plugin and no
# CUDA libraries (~180 MB of wheels, no driver needed), and no libtpu: the CUDA plugin and libtpu
# are two builds of XLA that we keep out of one process, so TPU compiles stay in the main one.
#
#   launch/aot_gpu_env.sh /path/to/venv-gpu
#   JAX_PLATFORMS=cpu /path/to/venv-gpu/bin/python -m pytest -q tests/test_topology.py
#
# Arguments and environment variables (defaults in brackets):
#   $1: where to make the venv (required; an existing venv there is reused)   PYTHON [python3]
# The repository is installed editable with its install_requires (torch, a test-only dependency,
# is not) and the aot-gpu extra, whose CUDA plugin is pinned to the jax that pip resolves; pytest
# for tests/test_topology.py. With JAX_PLATFORMS=cpu or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 jax
# skips the plugin's CUDA version check, which fails without CUDA.
set -euo pipefail

if [ $# -ne 1 ] || [ -z "$1" ]; then
    echo "usage: $0 VENV_DIR" >&2
    exit 2
fi
VENV=$1
PY=${PYTHON:-python3}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --upgrade pip
"$VENV/bin/python" -m pip install -e "${REPO}[aot-gpu]" pytest

# The check: the 8 compile-only H100s come up.
JAX_PLATFORMS=cpu "$VENV/bin/python" -c '
from tacl_jax.topology import compile_only_devices
devices = compile_only_devices("h100x8")
print(f"{len(devices)} compile-only devices: {devices[0].device_kind}")'
