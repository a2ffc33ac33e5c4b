#!/usr/bin/env bash
# Session 41, call 2: the Gluon rows kernel's GPU tests (its docstring changed after session 40's last
# GPU run, so the kernel recompiles), then OLMoE-8L's best-row profile on today's code (its non-GEMM
# share was last taken in session 10, on the H200: 29.6%), 40 kernels listed.
# Run from the repo root: bash docs/bench/session41/call2.sh (timeout 600; about 300 s on a fresh machine).
source docs/bench/session32/switches.sh
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
t0=$(date +%s)
timeout 280 python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/test_fp8_gluon.py 2>&1 | tail -3
echo "gluon tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 200 python3 tools/profile_step.py $S1 $(echo "$BEST" | tr ',' '\n' | sed 's/^/--/' | tr '\n' ' ') \
  --wait 1 --warmup 1 --active 2 --top 40 --json $OUT/profile_S1_best_top40.json 2>&1 | grep -v Warning | tail -45
echo "profile $(( $(date +%s) - t0 )) s"
