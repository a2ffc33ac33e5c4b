#!/usr/bin/env bash
# Where the ~2 ms a step of GPU idle that b16 and mxfp8 share is launched from (session 29's idle
# tables: the step's first zeros, each compiled block's entry, the clip norm's launches): the idle
# table with --stack names the project line behind each waited-for kernel. --stack slows the host,
# so this finds the sites; session 29's tables (without it) size them.
# Run from the repo root through the device tool: bash docs/bench/session29/call5.sh (timeout 300).
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
B16F="--optimizer.state_dtype=bf16 --precision.expert_weight_copies=optimizer --precision.expert_grads_bf16=true"
t0=$(date +%s)
timeout 200 python3 tools/profile_step.py $S1 $B16F --stack --wait 3 --warmup 1 --active 2 --top 3 \
  --json $OUT/profile_olmoe8l_b16_stack.json > $OUT/profile_olmoe8l_b16_stack.txt 2>&1
sed -n '/GPU idle per step/,$p' $OUT/profile_olmoe8l_b16_stack.txt | grep -v Warning | head -16
echo "profile $(( $(date +%s) - t0 )) s"
