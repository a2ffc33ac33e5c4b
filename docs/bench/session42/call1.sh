#!/usr/bin/env bash
# Queued by session 41. Both best rows profiled on whatever GPU comes (on an H200: the GEMM tables that
# GPU.gemm_eff's H200 figure lacks, and its optimizer and attention times beside the planner's terms).
# Run from the repo root: bash docs/bench/session42/call1.sh (timeout 600; about 200 s on a fresh machine).
source docs/bench/session32/switches.sh
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
FLAGS=$(echo "$BEST" | tr ',' '\n' | sed 's/^/--/' | tr '\n' ' ')
for s in S1 S2; do
  t0=$(date +%s)
  timeout 150 python3 tools/profile_step.py ${!s} $FLAGS --wait 1 --warmup 1 --active 2 --top 12 \
    --json $OUT/profile_${s}_best.json 2>&1 | grep -v Warning | grep -E 'ms wall|non-GEMM, non-attention share' | head -3
  echo "$s $(( $(date +%s) - t0 )) s"
done
