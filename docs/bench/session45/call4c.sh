#!/usr/bin/env bash
# Session 45, the last device time (about 500 s with a fresh machine's start): precision.bf16_residual off
# and on, compiled, on both #13 shapes (call4b.sh without its tests).
# Run from the repo root: bash docs/bench/session45/call4c.sh (timeout 210)
source docs/bench/session32/switches.sh
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
R=precision.bf16_residual=true
t0=$(date +%s)
timeout 115 python3 tools/bench_train.py $S2 --steps 10 --warmup 3 --variant best:$BEST --variant best_R:$BEST,$R \
  --json $OUT/S2_residual.json 2>&1 | grep -v Warning | tail -4
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 85 python3 tools/bench_train.py $S1 --steps 10 --warmup 3 --variant best:$BEST --variant best_R:$BEST,$R \
  --json $OUT/S1_residual.json 2>&1 | grep -v Warning | tail -4
echo "S1 $(( $(date +%s) - t0 )) s"
