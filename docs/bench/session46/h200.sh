#!/usr/bin/env bash
# Session 46's last call, for an H200 with the budget's last ~280 s: #13 on olmoe3-4l-8e against torchtitan on
# the GPU its targets were set on (the last same-run comparison there: session 22), short form: torchtitan 25
# steps after 5, then moetron's best (today's default stream) and best with the fp32 stream, 15 timed steps
# after 4. Needs .peers carried. Run from the repo root: bash docs/bench/session46/h200.sh (timeout 250)
source docs/bench/session42/common.sh
t0=$(date +%s)
tt olmoe3-4l-8e before 25
echo "torchtitan $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 120 python3 tools/bench_train.py $S2 --steps 15 --warmup 4 --variant best:$BEST \
  --variant best_fp32stream:$BEST,precision.bf16_residual=false --json $OUT/olmoe3_h200.json 2>&1 | grep -v Warning | tail -4
echo "S2 $(( $(date +%s) - t0 )) s"
