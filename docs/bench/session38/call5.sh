#!/usr/bin/env bash
# Queued for session 39 (session 38's device time was spent): the GPU tests not run in session 38 (native
# fp8_blockwise's shared-input linears against float64 and against the per-linear ones; the dense FP8
# linear against float64; the one-read quantization's bits), the one-read quantization's time, both
# shapes' b16 / f8gc steps on the session's last code (f8gc: the input quantized once, the new default),
# and OLMoE-8L's f8gc profile (the quantization's share after it; cut first if the call runs long).
# Run from the repo root: bash docs/bench/session38/call5.sh (timeout 600)
source docs/bench/session37/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/core/test_precision_input_once.py \
  tests/core/test_precision_fp8.py tests/core/test_blockwise_triton.py \
  -k "fp8_blockwise or blockwise_linears or test_fp8_on_gpu_matches_float64 or test_on_gpu_matches_reference" --tb=short 2>&1 \
  | grep -v Warning | tail -4
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
# the one-read quantization (blockwise_triton.TOKENS_FROM_TILE, off until measured: the "one read" column)
timeout 40 python3 tools/bench_quantize.py --json $OUT/quantize.json 2>&1 | grep -v Warning | tail -5
echo "quantize $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 130 python3 tools/bench_train.py $S1 --steps 8 --warmup 3 --variant b16:$B16 --variant f8gc:$F8,$G,$C \
  --json $OUT/steps_S1.json 2>&1 | grep -v Warning | tail -3
echo "S1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 140 python3 tools/bench_train.py $S2 --steps 8 --warmup 3 --variant b16:$B16 --variant f8gc:$F8,$G,$C \
  --json $OUT/steps_S2.json 2>&1 | grep -v Warning | tail -3
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 90 python3 tools/profile_step.py $S1 $(echo "$F8,$G,$C" | tr ',' '\n' | sed 's/^/--/' | tr '\n' ' ') \
  --wait 2 --warmup 1 --active 2 --top 12 --json $OUT/profile_S1_f8gc.json 2>&1 | grep -v Warning | tail -30
echo "profile $(( $(date +%s) - t0 )) s"
