#!/usr/bin/env bash
# Queued by session 51 (not run: the device budget was spent). SUITE=1: the whole GPU suite on session 51's code
# (split_master's auto, fit()'s hold of the masters; the defaults are session 50's). Otherwise (.peers carried): the
# default beside --optimizer.split_master=auto and the copies off, both shapes, torchtitan 0.3.0 after each, for
# #13's ratios in one run.
# Run from the repo root: SUITE=1 bash docs/bench/session51/next.sh (timeout 600; about 300-450 s), then
# bash docs/bench/session51/next.sh (timeout 600; about 330 s)
if [[ -n "${SUITE:-}" ]]; then
  source docs/bench/session25/common.sh
  t0=$(date +%s)
  MOETRON_PYTHON=$(command -v python3) MOETRON_TEST_WORKERS=3 timeout 560 bash tools/run_tests.sh -m gpu -q 2>&1 \
    | grep -v Warning | grep -E "passed|failed|FAILED|Error" | tail -15
  echo "GPU suite $(( $(date +%s) - t0 )) s"
  exit 0
fi
source docs/bench/session42/common.sh
OFF=precision.expert_weight_copies=none,precision.expert_grads_bf16=false,precision.dense_weight_copies=false,precision.head_weight_copy=false
timeout 150 python3 tools/bench_train.py $S2 --steps 30 --warmup 5 --variant default: \
  --variant auto:optimizer.split_master=auto --variant off:$OFF --json $OUT/olmoe3_split_auto.json 2>&1 \
  | grep -v Warning | tail -4
tt olmoe3-4l-8e after 35
timeout 120 python3 tools/bench_train.py $S1 --steps 12 --warmup 4 --variant default: \
  --variant auto:optimizer.split_master=auto --variant off:$OFF --json $OUT/olmoe8l_split_auto.json 2>&1 \
  | grep -v Warning | tail -4
tt olmoe-1b-7b-8l after 25
