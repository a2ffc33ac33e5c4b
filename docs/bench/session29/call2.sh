#!/usr/bin/env bash
# Session 29's device call 2 (session 28's queue items 2 and 3, trimmed to one call): the MX pair's tile
# sweep on this GPU (the default is now 128 columns on 8 warps, from the H100), OLMoE-8L b16 / mxcXI /
# mxcXQI interleaved over 12 steps (#14's 0.9x: 0.898x on the H100, 0.899x on the H200), and where the
# GPU idles in b16's and mxcXQI's steps (tools/profile_step.py's idle table: mxcXI idled 10.1 ms a step
# on the H100, b16 about 5 on the H200 in session 22 -- if the extra idle sits in a few launch sites it
# is a lever for the 0.9x).
# Run from the repo root through the device tool: bash docs/bench/session29/call2.sh (timeout 600).
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 70 python3 tools/bench_optim.py --variants triton_bf16_copy,triton_bf16_mxpair --steps 5 --warmup 2 \
  --mx-tiles 128x4,128x8,256x8,64x8 --json $OUT/optim.json 2>&1 | grep -v Warning | tail -7
echo "optim $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 230 python3 tools/bench_train.py $S1 --steps 12 --warmup 3 --variant b16:$B16 --variant mxcXI:$MXC,$X,$I \
  --variant mxcXQI:$MXC,$X,$Q,$I --variant b16b:$B16 --variant mxcXIb:$MXC,$X,$I \
  --json $OUT/olmoe8l.json 2>&1 | grep -v Warning | tail -7
echo "train s1 $(( $(date +%s) - t0 )) s"
B16F="--optimizer.state_dtype=bf16 --precision.expert_weight_copies=optimizer --precision.expert_grads_bf16=true"
MXF="$B16F --precision.recipe=mxfp8 --precision.backend=emulated --precision.emulated_save_x_bf16=true \
  --precision.quantize_input_once=true --precision.quantized_expert_copies=true"
for run in "b16:$B16F" "mxcXQI:$MXF"; do
  name=${run%%:*}; t0=$(date +%s)
  timeout 120 python3 tools/profile_step.py $S1 ${run#*:} --wait 3 --warmup 1 --active 2 --top 6 \
    --json $OUT/profile_olmoe8l_$name.json > $OUT/profile_olmoe8l_$name.txt 2>&1
  sed -n '/over 2 active/,$p' $OUT/profile_olmoe8l_$name.txt | grep -v Warning | head -45
  echo "profile $name $(( $(date +%s) - t0 )) s"
done
