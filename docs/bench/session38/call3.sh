#!/usr/bin/env bash
# Session 38, call 3: the fused SwiGLU quantization after call 2 (0.71x / 0.85x of f8gc: the backward prologue
# spilled 2.2 KB of registers a thread, the forward ran at 230 registers; now 32 rows or columns a step,
# no spills at 148-157 registers): its GPU tests, the kernels against the two they replace, both shapes'
# f8gc / f8gcs steps. Run from the repo root: bash docs/bench/session38/call3.sh (timeout 480)
source docs/bench/session37/common.sh
FS=precision.fp8_fused_swiglu=true
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/core/test_precision_fp8.py tests/core/test_blockwise_triton.py \
  -k "fused_swiglu or test_on_gpu_matches_reference" --tb=short 2>&1 | grep -v Warning | tail -4
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 40 python3 docs/bench/session38/swiglu_quant_probe.py --json $OUT/swiglu_quant.json 2>&1 | grep -v Warning | tail -8
echo "probe $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 110 python3 tools/bench_train.py $S1 --steps 8 --warmup 3 --variant f8gc:$F8,$G,$C --variant f8gcs:$F8,$G,$C,$FS \
  --json $OUT/steps_S1.json 2>&1 | grep -v Warning | tail -3
echo "S1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 120 python3 tools/bench_train.py $S2 --steps 8 --warmup 3 --variant f8gc:$F8,$G,$C --variant f8gcs:$F8,$G,$C,$FS \
  --json $OUT/steps_S2.json 2>&1 | grep -v Warning | tail -3
echo "S2 $(( $(date +%s) - t0 )) s"
