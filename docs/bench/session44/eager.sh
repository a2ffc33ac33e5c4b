#!/usr/bin/env bash
# Queued by session 43: the eager Triton kernels. model.triton_rope (written in session 43, never on a GPU):
# its GPU test and eager rows. model.triton_rmsnorm's default: session 43 measured it eager on the H100
# (+12.6% / +19.6% tokens/s, 5.1 GiB less) and ran its GPU tests; left: the GPU proxy's 200-step loss curve with it
# against two without (the eager step at this size is not bit-reproducible, session 40: the spread of the
# two is the noise). Any GPU; about 450 s on a fresh machine. Run from the repo root: bash docs/bench/session44/eager.sh
# (timeout 600).
source docs/bench/session32/switches.sh
# the example's own set-up would build a venv and pip-install torch (no network there): use the image's python
export MOETRON_PYTHON=$(command -v python3)
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/core/test_norm_triton.py tests/core/test_rope_triton.py \
  2>&1 | tail -2
# model.triton_rope (session 43, the same bits as the torch path, never run on a GPU): eager rows with it
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
N=model.triton_rmsnorm=true
R=model.triton_rope=true
for s in S2 S1; do
  shape=${!s}
  timeout 90 python3 tools/bench_train.py ${shape/ --compile/} --steps 8 --warmup 3 --variant best_N:$BEST,$N \
    --variant best_NR:$BEST,$N,$R --variant best_N_again:$BEST,$N --json $OUT/eager_${s}_rope.json 2>&1 | grep -v Warning | tail -4
done
for run in off:false on:true off2:false; do
  t0=$(date +%s)
  RUN_DIR=runs/proxy_norm_${run%%:*} STEPS=200 timeout 120 bash examples/pretrain_moe_1t.sh --checkpoint.keep_last=1 \
    --model.triton_rmsnorm=${run##*:} > $OUT/proxy_norm_${run%%:*}.log 2>&1
  cp runs/proxy_norm_${run%%:*}/metrics.jsonl $OUT/proxy_norm_${run%%:*}.jsonl 2>/dev/null
  tail -6 $OUT/proxy_norm_${run%%:*}.log
  echo "proxy ${run%%:*} $(( $(date +%s) - t0 )) s"
done
