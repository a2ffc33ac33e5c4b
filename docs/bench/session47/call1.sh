#!/usr/bin/env bash
# Session 47, call 1: optimizer.split_master on the GPU. Its tests (the kernel against adamw_update_ bit for
# bit, the optimizer against plain copies), then olmoe3-4l-8e's best row (the bf16 stream on by default) against
# best + split_master, alternating twice, and once with precision.head_grads_bf16 too, then torchtitan on olmoe3-4l-8e after it (the ratio in the same run).
# Needs .peers carried. OLMoE-8L and the optimizer alone: next.sh.
# Run from the repo root: bash docs/bench/session47/call1.sh (timeout 600; about 230 s warm).
source docs/bench/session42/common.sh
SP=optimizer.split_master=true
HG=precision.head_grads_bf16=true
t0=$(date +%s)
timeout 150 python3 -m pytest -q -m gpu tests/core/test_split_master.py 2>&1 | tail -3
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 150 python3 tools/bench_train.py $S2 --steps 30 --warmup 5 --variant best:$BEST --variant best_S:$BEST,$SP \
  --variant best_2:$BEST --variant best_S_2:$BEST,$SP --variant best_SH:$BEST,$SP,$HG \
  --json $OUT/olmoe3_split_x2.json 2>&1 | grep -v Warning | tail -7
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
tt olmoe3-4l-8e after 35
echo "torchtitan $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
