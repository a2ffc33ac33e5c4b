#!/usr/bin/env bash
# Queued by session 43: #13's eager path profiled (eager runs 0.70x / 0.81x compiled on OLMoE-8L /
# olmoe3-4l-8e, session 40, and has no kernel profile yet), both shapes' best rows without --compile, so the
# next eager lever is chosen from a profile. Any GPU; about 200 s on a fresh machine.
# Run from the repo root: bash docs/bench/session44/eager_profiles.sh (timeout 600).
source docs/bench/session32/switches.sh
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
FLAGS=$(echo "$BEST" | tr ',' '\n' | sed 's/^/--/' | tr '\n' ' ')
for s in S1 S2; do
  t0=$(date +%s)
  shape=${!s}
  timeout 200 python3 tools/profile_step.py ${shape/ --compile/} $FLAGS --wait 1 --warmup 1 --active 2 --top 25 \
    --json $OUT/profile_${s}_best_eager.json 2>&1 | grep -v Warning | tail -45
  echo "$s eager $(( $(date +%s) - t0 )) s"
done
