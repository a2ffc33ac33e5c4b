#!/usr/bin/env bash
# Session 38, call 2 (on 4c7b6c3): the GPU tests of the fused SwiGLU quantization and of session 37's
# last code (call 1's were cut by their timeout), the host probe with the FP8 GEMM ops registered through
# torch.library.Library (custom_op before: 230.6 us a rows op), and both shapes' b16 / f8gc / f8gc with
# precision.fp8_fused_swiglu=true (f8gcs), 8 timed steps after 3.
# Run from the repo root: bash docs/bench/session38/call2.sh (timeout 600)
source docs/bench/session37/common.sh
FS=precision.fp8_fused_swiglu=true
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider tests/core/test_precision_fp8.py tests/core/test_blockwise_triton.py \
  tests/core/test_fp8_gluon.py -k "fused_swiglu or bf16_weight_copies_on_gpu or test_on_gpu_matches_reference or test_fp8_gluon" --tb=short 2>&1 \
  | grep -v Warning | tail -8
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 45 python3 docs/bench/session37/host_probe.py --n 20 --json $OUT/host_probe.json 2>&1 | grep -v Warning | tail -18
echo "probe $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 140 python3 tools/bench_train.py $S1 --steps 8 --warmup 3 --variant b16:$B16 --variant f8gc:$F8,$G,$C \
  --variant f8gcs:$F8,$G,$C,$FS --json $OUT/steps_S1.json 2>&1 | grep -v Warning | tail -4
echo "S1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 160 python3 tools/bench_train.py $S2 --steps 8 --warmup 3 --variant b16:$B16 --variant f8gc:$F8,$G,$C \
  --variant f8gcs:$F8,$G,$C,$FS --json $OUT/steps_S2.json 2>&1 | grep -v Warning | tail -4
echo "S2 $(( $(date +%s) - t0 )) s"
