#!/usr/bin/env bash
# Call 3 of the next session lent the H200 (after session25/next_call.sh and session24/next_call2.sh,
# the overlap): the same switches on olmoe3-4l-8e (the issues ask for every switch's row on both
# shapes), fp8_rowwise's input_once included.
# Run from the repo root through the device tool: bash docs/bench/session25/next_call2.sh (timeout 600).
source docs/bench/session25/common.sh
t0=$(date +%s)
# the GPU tests of code session 25 refactored (the fused MX kernel through lean_rows_qdq) and fp8_rowwise's
timeout 150 python3 -m pytest -q -m gpu tests/core/test_fp8_rowwise.py tests/core/test_precision_emulated.py \
  tests/core/test_mx.py 2>&1 | grep -E "^E |passed|failed" | head -20
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 420 python3 tools/bench_train.py $S2 --steps 6 --warmup 3 --variant b16:$B16 --variant mxcX:$MXC,$X --variant mxcXQ:$MXC,$X,$Q \
  --variant mxcXI:$MXC,$X,$I --variant f8rfc:$F8RFC --variant f8rfcI:$F8RFC,$I --json $OUT/olmoe3.json 2>&1 \
  | grep -v Warning | tail -8
echo "train s2 $(( $(date +%s) - t0 )) s"
