#!/usr/bin/env bash
# Session 26's device call 1 (after session25/next_call.sh and session24/next_call2.sh ran): the GPU tests
# of the fused MX kernel session 25 refactored and of fp8_rowwise; the MX-pair kernel's tile sweep
# (it ran at 2971 GB/s against the plain copy's 4132); olmoe3-4l-8e rows (quantize_input_once's default).
# call2.sh has OLMoE-8L's rows.
# Run from the repo root through the device tool: bash docs/bench/session26/call1.sh (timeout 600).
source docs/bench/session25/common.sh
t0=$(date +%s)
# -v into a file: a test the timeout stops still leaves the ones before it (session25/next_call.sh's
# emulated -k quantized pair ran out of its 90 s compiling and printed nothing)
timeout 260 python3 -m pytest -v -m gpu tests/core/test_fp8_rowwise.py tests/core/test_precision_emulated.py \
  tests/core/test_mx.py > $OUT/gpu_tests.txt 2>&1
grep -E "^E |PASSED|FAILED|ERROR|passed|failed" $OUT/gpu_tests.txt | sed 's/^tests.core.//' | cut -c1-110 | head -30
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 90 python3 tools/bench_optim.py --variants triton_bf16_copy,triton_bf16_mxpair --steps 5 --warmup 2 \
  --mx-tiles 128x4,64x4,64x2,32x1,128x8,256x8,64x8,32x4 --json $OUT/optim.json 2>&1 | grep -v Warning | tail -12
echo "optim $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 170 python3 tools/bench_train.py $S2 --steps 6 --warmup 3 --variant b16:$B16 --variant mxcX:$MXC,$X \
  --variant mxcXI:$MXC,$X,$I --variant f8rfc:$F8RFC --variant f8rfcI:$F8RFC,$I --json $OUT/olmoe3.json 2>&1 \
  | grep -v Warning | tail -7
echo "train s2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
