#!/usr/bin/env bash
# One-shot GPU check for a machine with an NVIDIA GPU (a lent one or a user's).
# Installs the project if needed, then builds, validates and benchmarks the CUDA kernels
# (scripts/gpu_check.py): the tensor-core and the CUDA-core kernel, fp16/bf16, next to torch's
# FlashAttention-2 backend. Usage: scripts/gpu_check.sh [OUT_DIR] [extra gpu_check.py flags]
# Without a GPU: scripts/gpu_check.sh OUT --build-only --arch sm_90 builds every kernel offline.
# Offline machines: put the apache-tvm / apache-tvm-ffi wheels in ./.whl first.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-gpu_check_out}}
shift || true
mkdir -p "$OUT"
if ! python3 -c "import tvm, tvm_attention" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/tvm_attention_site .whl/*.whl
    export PYTHONPATH="/tmp/tvm_attention_site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  else
    python3 -m pip install -q -e .
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv || true
PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
