#!/usr/bin/env bash
# Session 49, call 1 (.peers carried): #13's "every switch's on/off row, on both shapes" for sessions 47-48's three
# switches, each alone beside the best row (S optimizer.split_master, H precision.head_grads_bf16, E
# precision.embedding_weight_copy) and all three (SHE), compiled, olmoe3-4l-8e then OLMoE-8L, each with torchtitan
# 0.3.0 after it in the same run (the 1.2x / 1.3x ratios).
# Run from the repo root: bash docs/bench/session49/call1.sh (timeout 600; about 400 s warm).
source docs/bench/session42/common.sh
SP=optimizer.split_master=true
HG=precision.head_grads_bf16=true
EC=precision.embedding_weight_copy=true
SHE=$SP,$HG,$EC
t0=$(date +%s)
timeout 200 python3 tools/bench_train.py $S2 --steps 30 --warmup 5 --variant best:$BEST --variant best_S:$BEST,$SP \
  --variant best_H:$BEST,$HG --variant best_E:$BEST,$EC --variant best_SHE:$BEST,$SHE --variant best_2:$BEST \
  --json $OUT/olmoe3_switches.json 2>&1 | grep -v Warning | tail -8
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
tt olmoe3-4l-8e after 35
echo "torchtitan S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 130 python3 tools/bench_train.py $S1 --steps 12 --warmup 4 --variant best:$BEST --variant best_S:$BEST,$SP \
  --variant best_H:$BEST,$HG --variant best_E:$BEST,$EC --variant best_SHE:$BEST,$SHE --variant best_2:$BEST \
  --json $OUT/olmoe8l_switches.json 2>&1 | grep -v Warning | tail -8
echo "S1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
tt olmoe-1b-7b-8l after 25
echo "torchtitan S1 $(( $(date +%s) - t0 )) s"
