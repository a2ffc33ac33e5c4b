#!/usr/bin/env bash
# Queued by session 47 (its device time ran out): OLMoE-8L with and without optimizer.split_master, the
# optimizer alone (bench_optim's split row against the plain copy), then session 46's queue (the GPU suite on
# the bf16-stream default and the profiles): bash docs/bench/session47/call2.sh.
# Run from the repo root: bash docs/bench/session47/next.sh (timeout 600; about 200 s warm).
source docs/bench/session42/common.sh
SP=optimizer.split_master=true
t0=$(date +%s)
timeout 200 python3 tools/bench_train.py $S1 --steps 12 --warmup 4 --variant best:$BEST --variant best_S:$BEST,$SP \
  --variant best_2:$BEST --variant best_S_2:$BEST,$SP --json $OUT/olmoe8l_split_x2.json 2>&1 | grep -v Warning | tail -6
echo "S1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 100 python3 -m pytest -q -m gpu tests/core/test_adamw_triton.py 2>&1 | tail -2
echo "adamw tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 80 python3 tools/bench_optim.py --variants triton_bf16_copy,triton_bf16_split --steps 10 --hbm-gbps 3350 \
  --json $OUT/bench_optim_split.json 2>&1 | grep -v Warning | tail -4
echo "bench_optim $(( $(date +%s) - t0 )) s"
