#!/usr/bin/env bash
# Session 32's queued call 2 (not yet run). olmoe3-4l-8e, one process: b16, the dense copies, the saved
# SwiGLU product, the loss in one 16384-token chunk (fewer read-modify-writes of the fp32 grad_W; 3.3 GB
# of transient logits), all of session 31-32's switches together, b16 again; then OLMoE-8L: b16, the
# prescale off, the Triton embedding gradient.
# Run from the repo root: bash docs/bench/session32/call2.sh (timeout 590; about 540 s warm-started).
source docs/bench/session32/switches.sh
t0=$(date +%s)
timeout 350 python3 tools/bench_train.py $S2 --steps 10 --warmup 3 --variant b16:$B16 \
  --variant b16D:$B16,$D --variant b16S:$B16,$S \
  --variant b16_c16k:$B16,model.loss_chunk_tokens=16384 --variant b16ALL:$B16,$ALL --variant b16_again:$B16 \
  --json $OUT/switches2_S2.json 2>&1 | grep -v Warning | tail -8
echo "S2 $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 200 python3 tools/bench_train.py $S1 --steps 10 --warmup 3 --variant b16:$B16 \
  --variant b16_noP:$B16,$P_OFF --variant b16E:$B16,$E \
  --json $OUT/switches1_S1.json 2>&1 | grep -v Warning | tail -5
echo "S1 $(( $(date +%s) - t0 )) s"
