#!/usr/bin/env bash
# Session 45, the last device time (about 410 s with a fresh machine's start): precision.bf16_residual off
# and on, compiled, on olmoe3-4l-8e, then residual_gradcmp.py on the GPU (the switch's gradient error).
# Run from the repo root: bash docs/bench/session45/call4d.sh (timeout 125)
source docs/bench/session32/switches.sh
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
R=precision.bf16_residual=true
timeout 95 python3 tools/bench_train.py $S2 --steps 8 --warmup 3 --variant best:$BEST --variant best_R:$BEST,$R \
  --json $OUT/S2_residual.json 2>&1 | grep -v Warning | tail -4
timeout 25 python3 docs/bench/session45/residual_gradcmp.py cuda 16384 2>&1 | grep -v Warning | tail -5
