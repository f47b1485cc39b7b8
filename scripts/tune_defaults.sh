#!/usr/bin/env bash
# Regenerate the committed tuning logs for the default CPU specs (fp32, B=1, H=8, D=64,
# S in {1024, 4096}, causal and not) on this machine's CPU. Resumable: rerun to continue.
# Usage: scripts/tune_defaults.sh [FUSED_TRIALS] [MATERIALIZED_TRIALS]
set -euo pipefail
FUSED_TRIALS=${1:-128}
MAT_TRIALS=${2:-32}
for S in 1024 4096; do
  for C in "" "--causal"; do
    tvm-attention tune --batch 1 --heads 8 --seq-q $S --head-dim 64 $C --trials "$FUSED_TRIALS"
    tvm-attention tune --batch 1 --heads 8 --seq-q $S --head-dim 64 $C --schedule materialized --trials "$MAT_TRIALS"
  done
done
