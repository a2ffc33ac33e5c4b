#!/usr/bin/env bash
# Session 47, the short form of call1.sh for a fresh machine with under 300 s of device time: the split tests on
# the GPU, then olmoe3-4l-8e best against best + optimizer.split_master (30 timed steps after 5).
# Run from the repo root: bash docs/bench/session47/call1_short.sh (about 150 s).
source docs/bench/session42/common.sh
SP=optimizer.split_master=true
t0=$(date +%s)
timeout 80 python3 -m pytest -q -m gpu tests/core/test_split_master.py 2>&1 | tail -3
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 100 python3 tools/bench_train.py $S2 --steps 30 --warmup 5 --variant best:$BEST --variant best_S:$BEST,$SP \
  --json $OUT/olmoe3_split.json 2>&1 | grep -v Warning | tail -4
echo "S2 $(( $(date +%s) - t0 )) s"
