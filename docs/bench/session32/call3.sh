#!/usr/bin/env bash
# Session 32's queued call 3 (not yet run). OLMoE-8L, one process: b16, the head's copy, the dense copies,
# the saved SwiGLU product, all of session 31-32's switches together, b16 again; then olmoe3-4l-8e on real
# text, b16 against the Triton embedding gradient.
# Run from the repo root: bash docs/bench/session32/call3.sh (timeout 590; about 480 s warm-started).
source docs/bench/session32/switches.sh
t0=$(date +%s)
timeout 400 python3 tools/bench_train.py $S1 --steps 10 --warmup 3 --variant b16:$B16 \
  --variant b16H:$B16,$H --variant b16D:$B16,$D \
  --variant b16S:$B16,$S --variant b16ALL:$B16,$ALL --variant b16_again:$B16 \
  --json $OUT/switches3_S1.json 2>&1 | grep -v Warning | tail -8
echo "S1 $(( $(date +%s) - t0 )) s"
# Real text (the embedded corpus): a frequent token's long run of rows is the Triton embedding
# gradient's worst case; random tokens have none.
t0=$(date +%s)
timeout 170 python3 tools/bench_train.py $S2 --real-text --steps 10 --warmup 3 --variant b16:$B16 \
  --variant b16E:$B16,$E --json $OUT/real_text_E_S2.json 2>&1 | grep -v Warning | tail -4
echo "S2 real text $(( $(date +%s) - t0 )) s"
