#!/usr/bin/env bash
# Session 51, call 5: optimizer.split_master's auto (on where the weight copies' auto is and the run holds copies to
# split), the default while this ran (taken back to off afterwards: docs/performance.md, session 51). The whole GPU
# suite on it (not completed), then OLMoE-8L compiled: the default then (split, printed by the build's start-up line)
# beside split_master=false (the default again now) and the copies off, in one process. Today the first row needs
# --variant auto:optimizer.split_master=auto.
# Run from the repo root: bash docs/bench/session51/call5.sh (timeout 500; about 400 s)
source docs/bench/session42/common.sh
OFF=precision.expert_weight_copies=none,precision.expert_grads_bf16=false,precision.dense_weight_copies=false,precision.head_weight_copy=false
t0=$(date +%s)
MOETRON_PYTHON=$(command -v python3) MOETRON_TEST_WORKERS=3 timeout 340 bash tools/run_tests.sh -m gpu -q 2>&1 \
  | grep -v Warning | grep -E "passed|failed|FAILED|Error" | tail -15
echo "GPU suite $(( $(date +%s) - t0 )) s"
timeout 100 python3 tools/bench_train.py $S1 --steps 10 --warmup 3 --variant default: \
  --variant no_split:optimizer.split_master=false --variant off:$OFF \
  --json $OUT/olmoe8l_split_auto.json 2>&1 | grep -v Warning | grep -E "precision: auto|variant|^default|^no_split|^off" | cut -c1-220
