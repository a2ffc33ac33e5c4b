#!/usr/bin/env bash
# Session 29's device call 1: session 28's queue (docs/bench/session28/README.md item 1) in one call.
# The GPU tests of the quantized copies (fixed in session 28: one batch three times), the MX pair's
# default of 8 warps (adamw_triton.MX_PAIR_WARPS, never run as the default on a GPU) and
# quantize_input_once; then b16 beside fp8_rowwise with and without quantize_input_once on OLMoE-8L
# (the same-machine ratio session 28 lacked), and the olmoe3-4l-8e pair that decides that switch's default.
# Run from the repo root through the device tool: bash docs/bench/session29/call1.sh (timeout 600).
source docs/bench/session25/common.sh
NI=precision.quantize_input_once=false
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 170 python3 -m pytest -v -m gpu tests/core/test_precision_emulated.py tests/core/test_adamw_triton.py \
  tests/core/test_precision_input_once.py > $OUT/gpu_tests.txt 2>&1
grep -E "^E |FAILED|ERROR|passed|failed" $OUT/gpu_tests.txt | sed 's/^tests.core.//' | cut -c1-110 | head -14
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 100 python3 tools/bench_train.py $S1 --steps 8 --warmup 3 --variant b16:$B16 --variant f8rfc:$F8RFC,$NI \
  --variant f8rfcI:$F8RFC,$I --json $OUT/olmoe8l.json 2>&1 | grep -v Warning | tail -5
echo "train s1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 150 python3 tools/bench_train.py $S2 --steps 6 --warmup 3 --variant f8rfc:$F8RFC,$NI --variant f8rfcI:$F8RFC,$I \
  --variant f8rfc2:$F8RFC,$NI --json $OUT/olmoe3.json 2>&1 | grep -v Warning | tail -5
echo "train s2 $(( $(date +%s) - t0 )) s"
