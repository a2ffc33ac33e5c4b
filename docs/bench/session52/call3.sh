#!/usr/bin/env bash
# Session 52, call 3: the whole GPU suite on optimizer.split_master's auto as the default (its freed parameters
# guarded: core/split_param.py). Run from the repo root: bash docs/bench/session52/call3.sh (timeout 600)
source docs/bench/session25/common.sh
t0=$(date +%s)
MOETRON_PYTHON=$(command -v python3) MOETRON_TEST_WORKERS=3 timeout 560 bash tools/run_tests.sh -m gpu -q 2>&1 \
  | grep -v Warning | grep -E "passed|failed|FAILED|Error" | tail -25
echo "GPU suite $(( $(date +%s) - t0 )) s"
