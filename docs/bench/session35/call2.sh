#!/usr/bin/env bash
# Session 35's call 2: the warp-specialized Gluon kernels in core/precision/fp8_gluon.py (persistent or
# one CTA a tile; 3 or 4 stages): their GPU tests, each GEMM of OLMoE's expert layer beside the
# pipelined Triton kernels and bf16, then fwd+bwd with quantization at bench_moe's shapes
# (#14's grouped target: fp8_blockwise >= 1.3x bf16 _grouped_mm, floor 1.1x).
# Run from the repo root: bash docs/bench/session35/call2.sh (timeout 330).
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 90 python3 -m pytest -q -m gpu tests/core/test_fp8_gluon.py 2>&1 | tail -3
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 110 python3 tools/bench_fp8_variants.py --shapes olmoe --gemms gate_up,down --iters 10 \
  --json $OUT/variants.json 2>&1 | grep -v Warning | tail -20
echo "variants $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 110 python3 tools/bench_gemm_fp8.py --skip-check --iters 10 --shapes olmoe olmo3-moe-8e --no-dense \
  --backends "fp8_blockwise" "fp8_blockwise gluon" --json $OUT/gemm_fp8.json 2>&1 | grep -v Warning | tail -12
echo "gemm_fp8 $(( $(date +%s) - t0 )) s"
