#!/usr/bin/env bash
# Session 32's queued call 1 (not yet run: no device was lent in session 32). The GPU tests of the
# switches built since the last GPU run (precision.dense_weight_copies, session 31; model.fused_loss_prescale
# and precision.head_weight_copy, session 32), then olmoe3-4l-8e in one process: b16 (the prescale on,
# the default), b16 with it off, b16 + the head's copy, b16 again (the noise).
# Run from the repo root: bash docs/bench/session32/call1.sh (timeout 590; about 420 s warm-started).
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 170 python3 -m pytest -q -m gpu tests/core/test_dense_copies.py tests/core/test_loss_triton.py 2>&1 | tail -3
echo "tests $(( $(date +%s) - t0 )) s"
H=precision.head_weight_copy=true
P=model.fused_loss_prescale=false
t0=$(date +%s)
timeout 380 python3 tools/bench_train.py $S2 --steps 12 --warmup 3 --variant b16:$B16 --variant b16_noP:$B16,$P \
  --variant b16H:$B16,$H --variant b16_again:$B16 --json $OUT/prescale_head_S2.json 2>&1 | grep -v Warning | tail -6
echo "S2 $(( $(date +%s) - t0 )) s"
