#!/usr/bin/env bash
# Regenerate the committed tuning logs for the default CPU specs (fp32, B=1, H=8, D=64,
# S in {1024, 4096}, causal and not) on this machine's CPU. Resumable: rerun to continue.
# Usage: scripts/tune_defaults.sh [FUSED_TRIALS] [MATERIALIZED_TRIALS]
#
# `tune` writes to the user's cache by default (~/.cache/tvm-attention/tuning_logs/...); the
# committed logs live in tuning_logs/ of this checkout, so every tune here gets an explicit
# --work-dir there (tuning_logs/<target key>/<spec>/, the folder `build` falls back to). Fused and
# materialized share that folder and therefore run one after the other: a tune holds the
# folder's lock, and a second one on it would stop at once.
set -euo pipefail
FUSED_TRIALS=${1:-128}
MAT_TRIALS=${2:-32}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

committed_dir() {  # committed_dir S [--causal] -> tuning_logs/<target key>/<spec> of this checkout
  python - "$REPO/tuning_logs" "$@" <<'PY'
import sys
from tvm_attention.spec import AttentionSpec
from tvm_attention.target import resolve_target
from tvm_attention.logs import log_folder
root, seq, flags = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
spec = AttentionSpec(batch=1, heads=8, seq_q=seq, head_dim=64, causal="--causal" in flags)
print(log_folder(root, spec, resolve_target("llvm")))
PY
}

for S in 1024 4096; do
  for C in "" "--causal"; do
    WORK=$(committed_dir $S $C)
    tvm-attention tune --batch 1 --heads 8 --seq-q $S --head-dim 64 $C --trials "$FUSED_TRIALS" --work-dir "$WORK"
    tvm-attention tune --batch 1 --heads 8 --seq-q $S --head-dim 64 $C --schedule materialized \
        --trials "$MAT_TRIALS" --work-dir "$WORK"
  done
done
