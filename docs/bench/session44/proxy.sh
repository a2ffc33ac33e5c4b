#!/usr/bin/env bash
# Session 44, call 3: the second half of eager.sh again (its first run in call 2 lacked MOETRON_PYTHON, so the
# example's set-up tried to pip-install torch and the three runs stopped at once), with one more run: norm and
# RoPE kernels both on. The GPU proxy (examples/pretrain_moe_1t.sh, eager, 200 steps, checkpoint and resume at
# 100): off, norm on, norm+rope on, off again. Run from the repo root: bash docs/bench/session44/proxy.sh
source docs/bench/session25/common.sh
export MOETRON_PYTHON=$(command -v python3)
for run in off:"--model.triton_rmsnorm=false" on:"--model.triton_rmsnorm=true" \
           onrope:"--model.triton_rmsnorm=true --model.triton_rope=true" off2:"--model.triton_rmsnorm=false"; do
  name=${run%%:*}
  t0=$(date +%s)
  RUN_DIR=runs/proxy_norm_$name STEPS=200 timeout 130 bash examples/pretrain_moe_1t.sh --checkpoint.keep_last=1 \
    ${run#*:} > $OUT/proxy_norm_$name.log 2>&1
  echo "[$name] rc=$? $(( $(date +%s) - t0 )) s"
  cp runs/proxy_norm_$name/metrics.jsonl $OUT/proxy_norm_$name.jsonl 2>/dev/null
  grep -E "^step +(1|100|200) " $OUT/proxy_norm_$name.log | tail -3
  grep -E "== summary|rror" $OUT/proxy_norm_$name.log | head -3
done
