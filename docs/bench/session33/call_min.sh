#!/usr/bin/env bash
# Session 33's last, smallest call (about 350 s of budget left after failed starts and a machine taken
# back mid-call): the GPU tests of precision.fp8_experts=triton_ws and optimizer.triton_grad_norm, then
# the warp-specialized kernels per pass on olmoe's gate|up beside bf16 and the pipelined ones.
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 100 python3 -m pytest -q -m gpu tests/core/test_precision_fp8.py tests/core/test_grad_norm_triton.py \
  -k "warp_specialized_on_gpu or gpu_matches_float64_and_the_foreach" 2>&1 | tail -4
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 80 python3 tools/bench_fp8_variants.py --shapes olmoe --gemms gate_up --iters 10 --json $OUT/variants.json 2>&1 \
  | grep -v Warning | tail -8
echo "variants $(( $(date +%s) - t0 )) s"
