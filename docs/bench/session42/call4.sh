#!/usr/bin/env bash
# Session 42: the whole GPU suite on today's code (113 tests marked gpu; the last whole run was session 20's,
# later sessions ran the changed modules only). One process, the slowest tests listed.
# Run from the repo root: bash docs/bench/session42/call4.sh (timeout 600).
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider tests --durations=15 --tb=short \
  --junitxml=$OUT/gpu_suite.xml 2>&1 | grep -v "Warning\|DEBUG\|warnings.warn" | tail -60
