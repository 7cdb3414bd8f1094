#!/usr/bin/env bash
# On a CUDA machine: kernel correctness tests on the GPU (compiled Triton, not the interpreter),
# then gather/scatter/page-copy bandwidth vs the device's copy bandwidth. Takes ~1-3 minutes.
# Usage: benchmarks/gpu_check.sh [--json PATH]
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
if ! "$PYTHON" -c 'import torch, triton, pytest, hypothesis, msgspec, pdflow' 2>/dev/null; then
  echo "== installing the repo with its kernels and dev extras"
  "$PYTHON" -m pip install --quiet -e '.[kernels,dev]'
fi
"$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device visible to torch")'

echo "== kernel correctness on CUDA"
unset TRITON_INTERPRET
PDFLOW_KERNEL_DEVICE=cuda timeout 240 "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels

echo "== bandwidth"
timeout 120 "$PYTHON" -m benchmarks.gpu_check "$@"
