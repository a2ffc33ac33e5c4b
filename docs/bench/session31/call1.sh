#!/usr/bin/env bash
# The GPU tests that session 30's call 5 did not reach (its 170 s timeout), with cols-first the MX
# tiles' default. Run from the repo root through the device tool: bash docs/bench/session31/call1.sh
# (timeout 560).
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 520 python3 -m pytest -q -m gpu tests/core/test_precision_emulated.py tests/core/test_adamw_triton.py \
  tests/core/test_mx.py tests/core/test_precision_input_once.py 2>&1 | tail -4
echo "tests $(( $(date +%s) - t0 )) s"
