#!/usr/bin/env bash
# Session 28's device call 1 (after session26/call1.sh and call2.sh ran on an H100 this morning):
# the quantized copies' GPU test (fixed: one batch three times), then call2.sh: fp8_rowwise's rows
# with and without quantize_input_once on both shapes (session26/call1.sh ran out of time before
# them). About 300 s at most: the session's device time ran low after refused starts.
# Run from the repo root through the device tool: bash docs/bench/session28/call1.sh (timeout 600).
source docs/bench/session25/common.sh
t0=$(date +%s)
timeout 100 python3 -m pytest -v -m gpu tests/core/test_precision_emulated.py -k quantized > $OUT/gpu_tests.txt 2>&1
grep -E "^E |PASSED|FAILED|ERROR|passed|failed" $OUT/gpu_tests.txt | sed 's/^tests.core.//' | cut -c1-110 | head -12
echo "tests $(( $(date +%s) - t0 )) s"
bash docs/bench/session28/call2.sh
