#!/usr/bin/env bash
# Session 41, call 4 (the last of the budget): one olmoe3-4l-8e best-row step as a chrome trace (gzipped), to
# read where the host falls behind the GPU. Run from the repo root: bash docs/bench/session41/call4.sh (about 60 s warm).
source docs/bench/session32/switches.sh
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
FLAGS=$(echo "$BEST" | tr ',' '\n' | sed 's/^/--/' | tr '\n' ' ')
timeout 150 python3 tools/profile_step.py $S2 $FLAGS --wait 1 --warmup 1 --active 1 --top 5 --trace $OUT/step_S2_best.json \
  2>&1 | grep -v Warning | grep -E "ms wall|GPU idle|non-GEMM, non-attention share"
gzip -9 $OUT/step_S2_best.json; ls -la $OUT
