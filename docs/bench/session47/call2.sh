#!/usr/bin/env bash
# Session 47, call 2 (right after call 1, on the warm machine): the whole GPU suite on session 46's default
# (precision.bf16_residual=auto: the bf16 stream in every bf16 GPU test; not run since that flip), then #13's
# non-GEMM share on olmoe3-4l-8e's best row with optimizer.split_master (tools/profile_step.py, 40 kernels,
# as session 40's call 4).
# Run from the repo root: bash docs/bench/session47/call2.sh (timeout 600; about 450 s warm).
source docs/bench/session42/common.sh
export MOETRON_PYTHON=$(command -v python3)
t0=$(date +%s)
MOETRON_PYTHON=python3 MOETRON_TEST_WORKERS=3 timeout 330 bash tools/run_tests.sh -m gpu > $OUT/gpu_suite.txt 2>&1
tail -3 $OUT/gpu_suite.txt; echo "gpu suite $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 110 python3 tools/profile_step.py $S2 $(echo "$BEST,optimizer.split_master=true" | tr ',' '\n' | sed 's/^/--/' | tr '\n' ' ') \
  --wait 1 --warmup 1 --active 2 --top 40 --json $OUT/profile_S2_best_split_top40.json 2>&1 | grep -v Warning \
  | grep -E "step|non-GEMM|fused_pointwise|elementwise|norm|routing|loss|optimizer" | head -24
echo "profile $(( $(date +%s) - t0 )) s"
