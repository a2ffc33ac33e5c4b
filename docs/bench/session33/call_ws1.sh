#!/usr/bin/env bash
# Session 33's queued call for the warp-specialized FP8 blockwise grouped GEMMs (precision.fp8_experts=triton_ws,
# core/precision/fp8_triton_ws.py; built and CPU-checked in session 33, never run on a GPU): their GPU
# tests against float64 and the masked kernels, then each GEMM alone beside bf16 and the pipelined
# kernels (tools/bench_fp8_variants.py: operands quantized beforehand), then fwd+bwd with quantization
# (tools/bench_gemm_fp8.py: #14's grouped target, fp8_blockwise >= 1.3x bf16, floor 1.1x).
# Run from the repo root: bash docs/bench/session33/call_ws1.sh (timeout 590; about 400 s warm-started).
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 150 python3 -m pytest -q -m gpu tests/core/test_precision_fp8.py \
  -k "warp_specialized or triton_ws" 2>&1 | tail -4
echo "tests $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 240 python3 tools/bench_fp8_variants.py --ws --shapes olmoe,olmo3-moe-8e --gemms gate_up,down --iters 10 \
  --json $OUT/variants.json 2>&1 | grep -v Warning | tail -30
echo "variants $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 150 python3 tools/bench_gemm_fp8.py --skip-check --iters 10 --no-dense --shapes olmoe olmo3-moe-3.2b olmo3-moe-8e \
  --backends fp8_blockwise "fp8_blockwise triton_ws" --json $OUT/gemm.json 2>&1 | grep -v Warning | tail -20
echo "gemm $(( $(date +%s) - t0 )) s"
