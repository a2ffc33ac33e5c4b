#!/usr/bin/env bash
# Session 42, on an H200 (the GPU #13's and #14's targets were set on; the last same-run torchtitan
# comparison on one was session 22's, before sessions 23-41's levers): olmoe3-4l-8e against torchtitan,
# moetron's best row twice and native fp8_blockwise's f8gc once between torchtitan's before and after
# (30 timed steps after 5, session 39 call 3's form). Needs .peers carried.
# Run from the repo root: bash docs/bench/session42/call2.sh (timeout 600; about 250 s warm).
source docs/bench/session42/common.sh
t0=$(date +%s)
tt olmoe3-4l-8e before 35
echo "torchtitan $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 280 python3 tools/bench_train.py $S2 --steps 30 --warmup 5 --variant best:$BEST --variant f8gc:$F8,$G,$C \
  --variant best_2:$BEST --json $OUT/olmoe3_best_x2_f8gc.json 2>&1 | grep -v Warning | tail -5
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
tt olmoe3-4l-8e after 35
echo "torchtitan $(( $(date +%s) - t0 )) s"
