#!/usr/bin/env bash
# Session 48, call 2 (after session 47's call1.sh, on the warm machine; budget too short for all of session 47's
# queue): the Triton AdamW kernel's GPU tests (its SPLIT path is new), the compiled best row's profile on
# olmoe3-4l-8e with optimizer.split_master and precision.head_grads_bf16 (#13's non-GEMM share), then OLMoE-8L
# with and without both (one pair, 12 steps).
# Run from the repo root: bash docs/bench/session48/call2.sh (timeout 600; about 260 s warm).
source docs/bench/session42/common.sh
SP=optimizer.split_master=true
HG=precision.head_grads_bf16=true
t0=$(date +%s)
timeout 100 python3 -m pytest -q -m gpu tests/core/test_adamw_triton.py 2>&1 | tail -2
echo "adamw tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 110 python3 tools/profile_step.py $S2 $(echo "$BEST,$SP,$HG" | tr ',' '\n' | sed 's/^/--/' | tr '\n' ' ') \
  --wait 1 --warmup 1 --active 2 --top 40 --json $OUT/profile_S2_best_SH_top40.json 2>&1 | grep -v Warning \
  | grep -E "step|non-GEMM|fused_pointwise|elementwise|norm|routing|loss|optimizer|gemm|attention" | head -24
echo "profile $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 150 python3 tools/bench_train.py $S1 --steps 12 --warmup 4 --variant best:$BEST --variant best_SH:$BEST,$SP,$HG \
  --json $OUT/olmoe8l_split.json 2>&1 | grep -v Warning | tail -4
echo "S1 $(( $(date +%s) - t0 )) s"
