#!/usr/bin/env bash
# Session 42, on an H200, after call 2: OLMoE-8L against torchtitan (before and after moetron's best row
# and f8gc, 20 timed steps after 5), then session 41's queued profiles (call1.sh) on the same machine.
# Needs .peers carried. Run from the repo root: bash docs/bench/session42/call3.sh (timeout 600; ~450 s warm).
source docs/bench/session42/common.sh
t0=$(date +%s)
tt olmoe-1b-7b-8l before 25
echo "torchtitan $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 200 python3 tools/bench_train.py $S1 --steps 20 --warmup 5 --variant best:$BEST --variant f8gc:$F8,$G,$C \
  --json $OUT/olmoe8l_best_f8gc.json 2>&1 | grep -v Warning | tail -4
echo "S1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
tt olmoe-1b-7b-8l after 25
echo "torchtitan $(( $(date +%s) - t0 )) s"
bash docs/bench/session42/call1.sh
