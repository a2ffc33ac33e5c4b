#!/usr/bin/env bash
# Queued for session 40, first: the kernel measurements that decide the next levers (about 300 s warm).
# 1. gluon_bf16_probe.py: a persistent warp-specialized bf16 grouped GEMM in Gluon against torch._grouped_mm
#    (forward and dgrad, both shapes): headroom there is #13's most direct route to its last 1%.
# 2. swiglu_gemm_probe.py: bf16 grouped GEMMs with the SwiGLU in their epilogues against _grouped_mm +
#    swiglu_triton (#13's non-GEMM share).
# 3. The Gluon FP8 rows kernel's raster groups (GluonConfig.group, #14): its GPU tests (run first: ROWS_CONFIGS
#    include groups of 2 and 3), then the expert GEMMs with groups of 1, 4 and 8.
# Run from the repo root: bash docs/bench/session39/call10.sh (timeout 600)
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
# first: the Gluon FP8 rows kernel's GPU tests (its tile order changed in session 39 after the last call:
# the default FP8 expert path on SM90; ROWS_CONFIGS include raster groups of 2 and 3)
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/core/test_fp8_gluon.py --tb=short 2>&1 \
  | grep -v "Warning\|DEBUG" | tail -3
echo "gluon tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 170 python3 docs/bench/session39/gluon_bf16_probe.py --json $OUT/gluon_bf16_probe.json 2>&1 | grep -v Warning | tail -50
echo "gluon bf16 probe $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 120 python3 docs/bench/session39/swiglu_gemm_probe.py --json $OUT/swiglu_gemm_probe.json 2>&1 | grep -v Warning | tail -30
echo "swiglu probe $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 100 python3 tools/bench_fp8_variants.py --shapes olmoe,olmo3-moe-8e --gemms gate_up,down --iters 10 --loop 10 \
  --gluon-configs "4,1,1,1;4,1,1,8;4,1,1,4" --gluon-k-configs "4,1,1" --json $OUT/gluon_groups.json 2>&1 \
  | grep -v Warning | tail -12
echo "gluon groups $(( $(date +%s) - t0 )) s"
