#!/usr/bin/env bash
# The GPU proxy (examples/pretrain_moe_1t.sh: one GPU, eager, 200 steps, checkpoint and resume at 100) once per
# argument NAME:"overrides", each in runs/proxy_norm_NAME, its log and metrics.jsonl under $OUT; prints the
# status, wall time, train loss at steps 10, 100, 200 and the summary of each. PROXY_TIMEOUT (seconds a run, default 130), PROXY_STEPS (default 200). Sourced setting: MOETRON_PYTHON
# (the example's own set-up would pip-install torch; the device has no network).
# Run from the repo root: bash docs/bench/session44/proxy_runs.sh off:"--model.triton_rmsnorm=false" ...
source docs/bench/session25/common.sh
export MOETRON_PYTHON=$(command -v python3)
for run in "$@"; do
  name=${run%%:*}
  t0=$(date +%s)
  RUN_DIR=runs/proxy_norm_$name STEPS=${PROXY_STEPS:-200} timeout ${PROXY_TIMEOUT:-130} bash examples/pretrain_moe_1t.sh --checkpoint.keep_last=1 \
    ${run#*:} > $OUT/proxy_norm_$name.log 2>&1
  echo "[$name] rc=$? $(( $(date +%s) - t0 )) s"
  cp runs/proxy_norm_$name/metrics.jsonl $OUT/proxy_norm_$name.jsonl 2>/dev/null
  grep -E "^step +(10|100|200) " $OUT/proxy_norm_$name.log | tail -3
  grep -E "== summary|rror" $OUT/proxy_norm_$name.log | head -3
done
