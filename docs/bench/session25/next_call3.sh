#!/usr/bin/env bash
# Call 4 of the next session lent the H200 (docs/bench/session25/README.md has the order):
# where the GPU idles inside the step (tools/profile_step.py's "GPU idle" table, new in session 25)
# for the bf16 and mxfp8-emulated steps of both shapes. Session 22's MXC profile had 211.0 ms wall
# against 201.8 ms of kernels (b16: 183.2 / 178.4): if the idle time sits between small kernels
# (host-bound launches) it is a lever for both missed targets (#13 olmoe3 1.13x of 1.2x; #14 OLMoE-8L
# mxfp8 0.893x of 0.9x, about 1.6 ms short); if it sits before the first kernel or after the last it
# is the profiler's per-step synchronize, not a lever.
# Run from the repo root through the device tool: bash docs/bench/session25/next_call3.sh (timeout 600).
source docs/bench/session25/common.sh
B16F="--optimizer.state_dtype=bf16 --precision.expert_weight_copies=optimizer --precision.expert_grads_bf16=true"
MXCXF="$B16F --precision.recipe=mxfp8 --precision.backend=emulated --precision.emulated_save_x_bf16=true"
for run in "olmoe8l_b16:$S1 $B16F" "olmoe8l_mxcX:$S1 $MXCXF" "olmoe3_b16:$S2 $B16F" "olmoe3_mxcX:$S2 $MXCXF"; do
  name=${run%%:*}; t0=$(date +%s)
  timeout 140 python3 tools/profile_step.py ${run#*:} --wait 3 --warmup 1 --active 2 --top 15 \
    --json $OUT/profile_$name.json 2>&1 | grep -v Warning | sed -n '/over 2 active/,$p' | head -60
  echo "$name $(( $(date +%s) - t0 )) s"
done
