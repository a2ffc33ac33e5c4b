#!/usr/bin/env bash
# Session 26, device call 1 (after session25/next_call.sh and session24/next_call2.sh ran): the GPU tests
# of the fused MX kernel session 25 refactored and of fp8_rowwise; the MX-pair kernel's tile sweep
# (it ran at 2971 GB/s against the plain copy's 4132); olmoe3-4l-8e rows; OLMoE-8L b16 / mxcXI
# interleaved over 12 steps (0.899x in next_call.sh, 6 steps); the idle table of OLMoE-8L's mxcXI.
# Run from the repo root through the device tool: bash docs/bench/session26/call1.sh (timeout 600).
source docs/bench/session25/common.sh
t0=$(date +%s)
# -v into a file: a test the timeout stops still leaves the ones before it (session25/next_call.sh's
# emulated -k quantized pair ran out of its 90 s compiling and printed nothing)
timeout 150 python3 -m pytest -v -m gpu tests/core/test_fp8_rowwise.py tests/core/test_precision_emulated.py \
  tests/core/test_mx.py > $OUT/gpu_tests.txt 2>&1
grep -E "^E |PASSED|FAILED|ERROR|passed|failed" $OUT/gpu_tests.txt | sed 's/^tests.core.//' | cut -c1-110 | head -30
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 90 python3 tools/bench_optim.py --variants triton_bf16_copy,triton_bf16_mxpair --steps 5 --warmup 2 \
  --mx-tiles 128x4,64x4,64x2,32x1,128x8,256x8 --json $OUT/optim.json 2>&1 | grep -v Warning | tail -8
echo "optim $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 160 python3 tools/bench_train.py $S2 --steps 6 --warmup 3 --variant b16:$B16 --variant mxcX:$MXC,$X \
  --variant mxcXI:$MXC,$X,$I --variant f8rfc:$F8RFC --variant f8rfcI:$F8RFC,$I --json $OUT/olmoe3.json 2>&1 \
  | grep -v Warning | tail -7
echo "train s2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 140 python3 tools/bench_train.py $S1 --steps 12 --warmup 3 --variant b16:$B16 --variant mxcXI:$MXC,$X,$I \
  --variant b16b:$B16 --variant mxcXIb:$MXC,$X,$I --json $OUT/olmoe8l.json 2>&1 | grep -v Warning | tail -6
echo "train s1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 70 python3 tools/profile_step.py $S1 --optimizer.state_dtype=bf16 --precision.expert_weight_copies=optimizer \
  --precision.expert_grads_bf16=true --precision.recipe=mxfp8 --precision.backend=emulated \
  --precision.emulated_save_x_bf16=true --precision.quantize_input_once=true --wait 3 --warmup 1 --active 2 --top 20 \
  --json $OUT/profile_olmoe8l_mxcXI.json 2>&1 | grep -v Warning | sed -n '/over 2 active/,$p' | head -50
echo "profile $(( $(date +%s) - t0 )) s"
