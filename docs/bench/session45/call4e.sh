#!/usr/bin/env bash
# Session 45, the last 305 s of device time: residual_gradcmp.py on the GPU first (about 25 s), then
# precision.bf16_residual off / on, compiled, on olmoe3-4l-8e (6 timed steps: a first look only).
# Run from the repo root: bash docs/bench/session45/call4e.sh
source docs/bench/session32/switches.sh
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
R=precision.bf16_residual=true
timeout 40 python3 docs/bench/session45/residual_gradcmp.py cuda 16384 2>&1 | grep -v Warning | tail -5 | tee $OUT/residual_gradcmp.txt
timeout 150 python3 tools/bench_train.py $S2 --steps 6 --warmup 2 --variant best:$BEST --variant best_R:$BEST,$R \
  --json $OUT/S2_residual.json 2>&1 | grep -v Warning | tail -4
