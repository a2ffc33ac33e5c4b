#!/usr/bin/env bash
# Session 34's call 4: precision.fp8_experts=triton_ws with 64-row tiles (call 3's bisection: the
# 128-row tiles split between two consumers are what Triton 3.6 gets wrong; the 64-row tiles were
# exact): its GPU tests, each GEMM beside bf16 and the pipelined kernels at OLMoE's shape, and
# fwd+bwd with quantization at OLMoE's and olmoe3-4l-8e's (#14's grouped target).
# Run from the repo root: bash docs/bench/session34/call4.sh (timeout 330).
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 110 python3 -m pytest -q -m gpu tests/core/test_precision_fp8.py -k "warp_specialized or triton_ws" 2>&1 | tail -4
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 100 python3 tools/bench_fp8_variants.py --ws --shapes olmoe --gemms gate_up,down --iters 10 \
  --json $OUT/variants.json 2>&1 | grep -v Warning | tail -16
echo "variants $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 100 python3 tools/bench_gemm_fp8.py --skip-check --iters 10 --no-dense --shapes olmoe olmo3-moe-8e \
  --backends fp8_blockwise "fp8_blockwise triton_ws" --json $OUT/gemm.json 2>&1 | grep -v Warning | tail -12
echo "gemm $(( $(date +%s) - t0 )) s"
