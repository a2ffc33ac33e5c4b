#!/usr/bin/env bash
# Session 49, call 3: the whole GPU suite (pytest -m gpu) on the bf16-stream default, not run whole since session 46
# made it the default (session 47's call2.sh, first half), three workers.
# Run from the repo root: bash docs/bench/session49/call3.sh (timeout 600; about 420 s warm).
source docs/bench/session42/common.sh
export MOETRON_PYTHON=$(command -v python3)
t0=$(date +%s)
MOETRON_PYTHON=python3 MOETRON_TEST_WORKERS=3 timeout 420 bash tools/run_tests.sh -m gpu > $OUT/gpu_suite.txt 2>&1
tail -5 $OUT/gpu_suite.txt; echo "gpu suite $(( $(date +%s) - t0 )) s"
grep -E "FAILED|ERROR" $OUT/gpu_suite.txt | head -20
