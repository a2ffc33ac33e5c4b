#!/usr/bin/env bash
# Queued by session 43: model.triton_rmsnorm's default. Session 43 measured it eager on the H100 (+12.6% /
# +19.6% tokens/s, 5.1 GiB less) and ran its GPU tests; left: the GPU proxy's 200-step loss curve with it
# against two without (the eager step at this size is not bit-reproducible, session 40: the spread of the
# two is the noise), then OLMoE-8L's eager profile with it (olmoe3-4l-8e's is session 43's call 6).
# Any GPU; about 350 s on a fresh machine. Run from the repo root: bash docs/bench/session44/eager.sh
# (timeout 600).
source docs/bench/session32/switches.sh
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/core/test_norm_triton.py 2>&1 | tail -2
for run in off:false on:true off2:false; do
  t0=$(date +%s)
  RUN_DIR=runs/proxy_norm_${run%%:*} STEPS=200 timeout 150 bash examples/pretrain_moe_1t.sh --checkpoint.keep_last=1 \
    --model.triton_rmsnorm=${run##*:} > $OUT/proxy_norm_${run%%:*}.log 2>&1
  cp runs/proxy_norm_${run%%:*}/metrics.jsonl $OUT/proxy_norm_${run%%:*}.jsonl 2>/dev/null
  tail -6 $OUT/proxy_norm_${run%%:*}.log
  echo "proxy ${run%%:*} $(( $(date +%s) - t0 )) s"
done
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384,model.triton_rmsnorm=true
FLAGS=$(echo "$BEST" | tr ',' '\n' | sed 's/^/--/' | tr '\n' ' ')
timeout 100 python3 tools/profile_step.py ${S1/ --compile/} $FLAGS --wait 1 --warmup 1 --active 1 --top 25 \
  --json $OUT/profile_S1_best_norm_eager.json 2>&1 | grep -v Warning | tail -40
