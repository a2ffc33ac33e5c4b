#!/usr/bin/env bash
# Session 32's queued call 1 (not yet run: no device was lent in session 32). The GPU tests of the
# switches built since the last GPU run (precision.dense_weight_copies, session 31; model.fused_loss_prescale,
# precision.head_weight_copy, model.triton_embedding_grad and precision.save_swiglu_product, session 32), the loss' row kernel's
# settings (tools/bench_loss.py --rows), then olmoe3-4l-8e in one process: b16 (the prescale on, the
# default), b16 with it off, b16 + the head's copy, b16 + the Triton embedding gradient, b16 again.
# Run from the repo root: bash docs/bench/session32/call1.sh (timeout 590; about 540 s warm-started).
source docs/bench/session32/switches.sh
t0=$(date +%s)
timeout 150 python3 -m pytest -q -m gpu tests/core/test_dense_copies.py tests/core/test_loss_triton.py \
  tests/core/test_embedding.py tests/core/test_swiglu_triton.py 2>&1 | tail -3
echo "tests $(( $(date +%s) - t0 )) s"
# The fused loss' Triton row kernel alone: block x warps x the gradient pass's direction (REVERSED, session 32).
t0=$(date +%s)
timeout 80 python3 tools/bench_loss.py --rows --chunk-tokens 4096 --json $OUT/ce_rows.json 2>&1 | grep -v Warning | tail -20
echo "rows $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 340 python3 tools/bench_train.py $S2 --steps 12 --warmup 3 --variant b16:$B16 --variant b16_noP:$B16,$P_OFF \
  --variant b16H:$B16,$H --variant b16E:$B16,$E --variant b16_again:$B16 --json $OUT/prescale_head_S2.json 2>&1 | grep -v Warning | tail -7
echo "S2 $(( $(date +%s) - t0 )) s"
