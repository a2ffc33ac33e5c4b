#!/usr/bin/env bash
# Session 35's call 4: the Gluon GPU test with its traceback (call 2: failed, summary only), then
# call3.sh's steps (fp8_experts=gluon: the Gluon rows kernels, the pipelined Triton wgrad).
# Run from the repo root: bash docs/bench/session35/call4.sh (timeout 590).
source docs/bench/session25/common.sh
t0=$(date +%s)
timeout 60 python3 -m pytest -q -x -m gpu tests/core/test_fp8_gluon.py --tb=short 2>&1 | grep -v Warning | tail -30
echo "tests $(( $(date +%s) - t0 )) s"
bash docs/bench/session35/call3.sh
