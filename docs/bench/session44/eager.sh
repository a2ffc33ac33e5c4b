#!/usr/bin/env bash
# Queued by session 43: #13's eager path. model.triton_rmsnorm (session 43, core/layers/norm_triton.py)
# has run only under the CPU interpreter: its GPU test first, then both shapes' best rows eager with and
# without it (between two rows without, for the noise), then both best rows profiled eager (eager runs
# 0.70x / 0.81x compiled on OLMoE-8L / olmoe3-4l-8e, session 40, and has had no kernel profile), without
# the switch. Any GPU; about 350 s on a fresh machine.
# Run from the repo root: bash docs/bench/session44/eager.sh (timeout 600).
source docs/bench/session32/switches.sh
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
N=model.triton_rmsnorm=true
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/core/test_norm_triton.py 2>&1 | tail -3
for s in S1 S2; do
  t0=$(date +%s)
  shape=${!s}
  timeout 150 python3 tools/bench_train.py ${shape/ --compile/} --steps 10 --warmup 3 --variant best:$BEST \
    --variant best_norm:$BEST,$N --variant best_again:$BEST --json $OUT/eager_${s}_norm.json 2>&1 | grep -v Warning | tail -5
  echo "$s eager rows $(( $(date +%s) - t0 )) s"
done
FLAGS=$(echo "$BEST" | tr ',' '\n' | sed 's/^/--/' | tr '\n' ' ')
for s in S1 S2; do
  t0=$(date +%s)
  shape=${!s}
  timeout 100 python3 tools/profile_step.py ${shape/ --compile/} $FLAGS --wait 1 --warmup 1 --active 2 --top 25 \
    --json $OUT/profile_${s}_best_eager.json 2>&1 | grep -v Warning | tail -40
  echo "$s eager profile $(( $(date +%s) - t0 )) s"
done
