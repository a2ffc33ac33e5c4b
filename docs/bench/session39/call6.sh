#!/usr/bin/env bash
# trainer.cuda_graph's GPU tests over the recipes (native fp8_blockwise, mxfp8 emulated, full recompute),
# then olmoe3-4l-8e's best bf16 row profiled on today's code (#13's non-GEMM share; last in session 35).
# Run from the repo root: bash docs/bench/session39/call6.sh (timeout 450)
source docs/bench/session32/switches.sh
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
t0=$(date +%s)
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/core/test_cuda_graph.py --tb=short 2>&1 \
  | grep -v Warning | tail -25
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 120 python3 tools/profile_step.py $S2 $(echo "$BEST" | tr ',' '\n' | sed 's/^/--/' | tr '\n' ' ') \
  --wait 1 --warmup 1 --active 2 --top 14 --json $OUT/profile_S2_best.json 2>&1 | grep -v Warning | tail -40
echo "profile $(( $(date +%s) - t0 )) s"
