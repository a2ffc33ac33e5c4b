#!/usr/bin/env bash
# #13: the GEMM table (profile_step's new gemm_table: each GEMM's op, operand shapes and achieved
# TFLOP/s) on both shapes' b16 step, to check session 30's aggregate reading (olmoe3-4l-8e's grouped
# GEMMs at 688 TFLOP/s, its dense ones at about 680) GEMM by GEMM; and --stack with the verbose config.
# Run from the repo root: bash docs/bench/session31/call2.sh (timeout 400).
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
B16F="--optimizer.state_dtype=bf16 --precision.expert_weight_copies=optimizer --precision.expert_grads_bf16=true"
for shape in S2 S1; do
  t0=$(date +%s)
  timeout 120 python3 tools/profile_step.py ${!shape} $B16F --wait 3 --warmup 1 --active 2 --top 40 \
    --json $OUT/profile_${shape}_b16.json > $OUT/profile_${shape}_b16.txt 2>&1
  sed -n '/GEMMs by op/,/non-GEMM/p' $OUT/profile_${shape}_b16.txt | cut -c1-160
  echo "$shape $(( $(date +%s) - t0 )) s"
done
t0=$(date +%s)
timeout 120 python3 tools/profile_step.py $S1 $B16F --stack --wait 3 --warmup 1 --active 2 --top 3 \
  --json $OUT/profile_S1_b16_stack.json > $OUT/profile_S1_b16_stack.txt 2>&1
sed -n '/GPU idle per step/,/^$/p' $OUT/profile_S1_b16_stack.txt | head -12 | cut -c1-230; grep "recorded no Python" $OUT/profile_S1_b16_stack.txt
echo "stack $(( $(date +%s) - t0 )) s"
