#!/usr/bin/env bash
# call1.sh for a short budget (about 250 s): the quantized copies' GPU test and olmoe3-4l-8e's
# fp8_rowwise pair with and without quantize_input_once (the rows that decide that switch's default).
# Run from the repo root through the device tool: bash docs/bench/session29/call1b.sh (timeout 300).
source docs/bench/session25/common.sh
NI=precision.quantize_input_once=false
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 100 python3 -m pytest -v -m gpu tests/core/test_precision_emulated.py -k quantized > $OUT/gpu_tests.txt 2>&1
grep -E "^E |FAILED|ERROR|passed|failed" $OUT/gpu_tests.txt | sed 's/^tests.core.//' | cut -c1-110 | head -8
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 150 python3 tools/bench_train.py $S2 --steps 6 --warmup 3 --variant f8rfc:$F8RFC,$NI --variant f8rfcI:$F8RFC,$I \
  --json $OUT/olmoe3.json 2>&1 | grep -v Warning | tail -4
echo "train s2 $(( $(date +%s) - t0 )) s"
