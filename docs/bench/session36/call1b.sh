#!/usr/bin/env bash
# Session 36 call 1b: call1.sh trimmed to fit one call with the first compiled steps of the Gluon path
# (device starts are scarce this session): the Gluon GPU tests, wgrad_probe.py, the expert GEMMs with
# --loop 10 (the rings and the TMA store that were not measured before), fwd+bwd with quantization at
# the grouped target's two shapes, and olmoe3-4l-8e's steps b16 / f8g (session 35's f8g failed to compile).
# Run from the repo root: bash docs/bench/session36/call1b.sh (timeout 600; about 560 s at most).
source docs/bench/session25/common.sh
F8=optimizer.state_dtype=bf16,precision.recipe=fp8_blockwise
G=precision.fp8_experts=gluon
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 80 python3 -m pytest -q -m gpu tests/core/test_fp8_gluon.py --tb=short 2>&1 | grep -v Warning | tail -15
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 80 python3 docs/bench/session35/wgrad_probe.py 2>&1 | grep -v Warning | tail -34
echo "wgrad probe $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 120 python3 tools/bench_fp8_variants.py --shapes olmoe --gemms gate_up,down --iters 10 --loop 10 \
  --gluon-configs "4,1;5,1;6,1;4,1,1;5,1,1;6,1,1" --gluon-k-configs "4,1;4,1,1" --json $OUT/variants_loop10.json 2>&1 \
  | grep -v Warning | tail -14
echo "variants $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 100 python3 tools/bench_gemm_fp8.py --iters 10 --shapes olmoe olmo3-moe-3.2b --no-dense \
  --backends "fp8_blockwise gluon" "fp8_blockwise gluon bf16-wgrad" --json $OUT/gemm_fp8.json 2>&1 | grep -v Warning | tail -16
echo "gemm_fp8 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 170 python3 tools/bench_train.py $S2 --steps 8 --warmup 3 --variant b16:$B16 --variant f8g:$F8,$G \
  --json $OUT/steps_S2.json 2>&1 | grep -v Warning | tail -4
echo "S2 $(( $(date +%s) - t0 )) s"
