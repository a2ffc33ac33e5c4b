#!/usr/bin/env bash
# profile_step --stack again with its frame match fixed (session 29's call5 named no project line:
# the profiler names frames relative to sys.path), on OLMoE-8L b16; then mxcXI's profile on this GPU
# (where its ~27 ms over b16 goes on an H100); then olmoe3-4l-8e b16's top kernels (#13: its GEMMs one by one).
# Run from the repo root: bash docs/bench/session30/call4.sh (timeout 420).
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
B16F="--optimizer.state_dtype=bf16 --precision.expert_weight_copies=optimizer --precision.expert_grads_bf16=true"
MXF="$B16F --precision.recipe=mxfp8 --precision.backend=emulated --precision.emulated_save_x_bf16=true"
t0=$(date +%s)
timeout 150 python3 tools/profile_step.py $S1 $B16F --stack --wait 3 --warmup 1 --active 2 --top 3 \
  --json $OUT/profile_olmoe8l_b16_stack.json > $OUT/profile_olmoe8l_b16_stack.txt 2>&1
sed -n '/GPU idle per step/,$p' $OUT/profile_olmoe8l_b16_stack.txt | grep -v Warning | head -14 | cut -c1-230
echo "profile stack $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 130 python3 tools/profile_step.py $S1 $MXF --wait 3 --warmup 1 --active 2 --top 8 \
  --json $OUT/profile_olmoe8l_mxcXI.json > $OUT/profile_olmoe8l_mxcXI.txt 2>&1
sed -n '/over 2 active/,/GPU idle/p' $OUT/profile_olmoe8l_mxcXI.txt | grep -v Warning | cut -c1-150
echo "profile mxcXI $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 110 python3 tools/profile_step.py $S2 $B16F --wait 3 --warmup 1 --active 2 --top 16 \
  --json $OUT/profile_olmoe3_b16.json > $OUT/profile_olmoe3_b16.txt 2>&1
sed -n '/over 2 active/,/GPU idle/p' $OUT/profile_olmoe3_b16.txt | grep -v Warning | cut -c1-150
echo "profile olmoe3 b16 $(( $(date +%s) - t0 )) s"
