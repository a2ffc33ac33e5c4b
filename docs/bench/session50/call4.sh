#!/usr/bin/env bash
# Session 50, call 4 (.peers carried): the new default (the weight copies auto, on here: one GPU, one micro-batch)
# against the four switches off, compiled, both shapes, torchtitan 0.3.0 after each in the same run; then the GPU
# proxy (examples/pretrain_moe_1t.sh: the entry point that resolves auto through run/build.py) at seeds 0 and 1 on
# the new default, for docs/bench/session50/compare_auto.sh (CPU) against session 46's default runs of those seeds.
# Run from the repo root: bash docs/bench/session50/call4.sh (timeout 600; about 400 s)
source docs/bench/session42/common.sh
OFF=precision.expert_weight_copies=none,precision.expert_grads_bf16=false,precision.dense_weight_copies=false,precision.head_weight_copy=false
t0=$(date +%s)
timeout 150 python3 tools/bench_train.py $S2 --steps 30 --warmup 5 --variant default: --variant off:$OFF \
  --json $OUT/olmoe3_auto.json 2>&1 | grep -v Warning | tail -4
echo "S2 $(( $(date +%s) - t0 )) s"
tt olmoe3-4l-8e after 35
t0=$(date +%s)
timeout 120 python3 tools/bench_train.py $S1 --steps 12 --warmup 4 --variant default: --variant off:$OFF \
  --json $OUT/olmoe8l_auto.json 2>&1 | grep -v Warning | tail -4
echo "S1 $(( $(date +%s) - t0 )) s"
tt olmoe-1b-7b-8l after 25
rm -rf runs/proxy_norm_s0_A runs/proxy_norm_s1_A
PROXY_TIMEOUT=140 bash docs/bench/session44/proxy_runs.sh s0_A:"--trainer.seed=0" s1_A:"--trainer.seed=1"
grep -m1 "precision: auto" $OUT/proxy_norm_s0_A.log
