#!/usr/bin/env bash
# Ready for the next session lent the H200 (sessions 24 and 25 had no device), call 1 (the first to
# run: #14's 0.9x on OLMoE-8L). GPU tests of precision.quantized_expert_copies (the optimizer's MX-pair
# kernel, session 25) and precision.quantize_input_once (session 24), then both switches on and off on
# OLMoE-8L, mxfp8 emulated on the optimizer's copies with emulated_save_x_bf16 (session 23's best,
# 0.893x). Planned (tools/plan.py): mxcX 214.2 ms, mxcXI 213.4, mxcXQ 207.5.
# Run from the repo root through the device tool: bash docs/bench/session25/next_call.sh (timeout 600).
source docs/bench/session25/common.sh
t0=$(date +%s)
timeout 80 python3 -m pytest -q -m gpu tests/core/test_adamw_triton.py tests/core/test_precision_input_once.py \
  2>&1 | grep -E "^E |passed|failed" | head -20
timeout 90 python3 -m pytest -q -m gpu tests/core/test_precision_emulated.py -k quantized 2>&1 \
  | grep -E "^E |passed|failed" | head -20
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
# the MX-pair kernel alone against the plain copy's (OLMoE-8L's 3.77B parameters; floor at 4.3 TB/s)
timeout 60 python3 tools/bench_optim.py --variants triton_bf16_copy,triton_bf16_mxpair --steps 5 --warmup 2 \
  --json $OUT/optim.json 2>&1 | grep -v Warning | tail -3
echo "optim $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 380 python3 tools/bench_train.py $S1 --steps 6 --warmup 3 --variant b16:$B16 --variant mxcX:$MXC,$X --variant mxcXQ:$MXC,$X,$Q \
  --variant mxcXI:$MXC,$X,$I --variant mxcXQI:$MXC,$X,$Q,$I --json $OUT/olmoe8l.json 2>&1 | grep -v Warning | tail -7
echo "train s1 $(( $(date +%s) - t0 )) s"
