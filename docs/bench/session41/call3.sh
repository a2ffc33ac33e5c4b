#!/usr/bin/env bash
# Session 41, call 3: the moe-1t per-rank slice (ep 8, pp 8, 2 MoE blocks, 8192 tokens, 16 local experts
# at full width, compiled) in bf16 and native fp8_blockwise on today's code, beside the planner's refitted
# rates (bench_slice prints the plan for this GPU): the refit's check at the 1.2T recipe's expert shape,
# which none of its fitted profiles has (the bf16 slice last ran in session 5, on the H200).
# Run from the repo root: bash docs/bench/session41/call3.sh (timeout 600; about 400 s).
source docs/bench/session25/common.sh
t0=$(date +%s)
timeout 300 python3 tools/bench_slice.py --preset moe-1t --ep 8 --pp 8 --layers 2 --seq-len 8192 --steps 4 --warmup 2 \
  --compile --variant bf16:memory.recompute=none --variant fp8:precision.recipe=fp8_blockwise,memory.recompute=none \
  --json $OUT/slice.json 2>&1 | grep -v Warning | tail -12
echo "slice $(( $(date +%s) - t0 )) s"
# Then olmoe3-4l-8e's best row profiled with --stack: where each gap of GPU idle (3.1 ms a step in session
# 40's profile, 1.1% of the step: as much as #13's 1.2x misses by) was launched from in this project's code.
source docs/bench/session32/switches.sh
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
t0=$(date +%s)
timeout 150 python3 tools/profile_step.py $S2 $(echo "$BEST" | tr ',' '\n' | sed 's/^/--/' | tr '\n' ' ') \
  --wait 1 --warmup 1 --active 3 --top 5 --stack --json $OUT/profile_S2_best_stack.json 2>&1 | grep -v Warning \
  | sed -n '/GPU idle/,/GEMMs by op/p' | head -40
echo "profile $(( $(date +%s) - t0 )) s"
