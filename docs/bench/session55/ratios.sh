#!/usr/bin/env bash
# Session 55, call 4 (.peers carried): #13's two ratios on today's code (split_master auto by default since session
# 52, its guard, the deterministic switch): the default and best + SHE (BEST plus optimizer.split_master,
# precision.head_grads_bf16 and precision.embedding_weight_copy, as measured in sessions 48-49), compiled,
# olmoe3-4l-8e (default, best_SHE, default again, 30 timed steps after 5) then OLMoE-8L (12 after 4), each with
# torchtitan 0.3.0 after it in the same run.
# Run from the repo root: bash docs/bench/session55/ratios.sh (timeout 600; about 300 s on a fresh machine).
source docs/bench/session42/common.sh
t0=$(date +%s)
timeout 200 python3 tools/bench_train.py $S2 --steps 30 --warmup 5 --variant default: --variant best_SHE:$BEST,$SHE \
  --variant default_2: --json $OUT/olmoe3_ratio.json 2>&1 | grep -v Warning | tail -5
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
tt olmoe3-4l-8e after 35
echo "torchtitan S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 130 python3 tools/bench_train.py $S1 --steps 12 --warmup 4 --variant default: --variant best_SHE:$BEST,$SHE \
  --json $OUT/olmoe8l_ratio.json 2>&1 | grep -v Warning | tail -4
echo "S1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
tt olmoe-1b-7b-8l after 25
echo "torchtitan S1 $(( $(date +%s) - t0 )) s"
