#!/usr/bin/env bash
# Session 46: #13 on olmoe3-4l-8e against torchtitan with precision.bf16_residual (call 1: best_R 1.011x best
# compiled, best_2 1.010x: within noise). Torchtitan before and after, moetron's best and best_R alternating
# twice (30 timed steps after 5; session 42 call 2's form). Needs .peers carried.
# Run from the repo root: bash docs/bench/session46/call2.sh (timeout 600; about 400 s warm).
source docs/bench/session42/common.sh
R=precision.bf16_residual=true
t0=$(date +%s)
tt olmoe3-4l-8e before 35
echo "torchtitan $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 330 python3 tools/bench_train.py $S2 --steps 30 --warmup 5 --variant best:$BEST --variant best_R:$BEST,$R \
  --variant best_2:$BEST --variant best_R_2:$BEST,$R --json $OUT/olmoe3_best_R_x2.json 2>&1 | grep -v Warning | tail -6
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
tt olmoe3-4l-8e after 35
echo "torchtitan $(( $(date +%s) - t0 )) s"
