#!/usr/bin/env bash
# Session 36 call 3: the wgrad with its scales staged in shared memory (fp8_gluon K_CONFIG (4, persistent,
# TMA store), K-block-major token scales) and the pipelined kernels behind custom ops (no more eager
# fallback of the grouped GEMM under torch.compile): GPU tests, the expert GEMMs (--loop 10), fwd+bwd with
# quantization at the grouped target's shapes, and the steps of both shapes (#14's step targets).
# Run from the repo root: bash docs/bench/session36/call3.sh (timeout 600; about 480 s).
source docs/bench/session25/common.sh
F8=optimizer.state_dtype=bf16,precision.recipe=fp8_blockwise
G=precision.fp8_experts=gluon
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 100 python3 -m pytest -q -m gpu tests/core/test_fp8_gluon.py tests/core/test_precision_fp8.py --tb=short 2>&1 \
  | grep -v Warning | grep -E "^(FAILED|ERROR|E  )|passed|failed" | head -20
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 70 python3 tools/bench_fp8_variants.py --shapes olmoe --gemms gate_up,down --iters 10 --loop 10 \
  --gluon-configs "4,1,1" --gluon-k-configs "4,1,1;4,1" --json $OUT/variants_loop10.json 2>&1 \
  | grep -v Warning | tail -14
echo "variants $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 110 python3 tools/bench_gemm_fp8.py --iters 10 --skip-check --shapes olmoe olmo3-moe-3.2b olmo3-moe-8e --no-dense \
  --backends "fp8_blockwise gluon" "fp8_blockwise" --profile --top 8 --json $OUT/gemm_fp8.json 2>&1 | grep -v Warning | tail -60
echo "gemm_fp8 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 150 python3 tools/bench_train.py $S2 --steps 8 --warmup 3 --variant b16:$B16 --variant f8g:$F8,$G \
  --variant f8:$F8 --json $OUT/steps_S2.json 2>&1 | grep -v Warning | tail -5
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 140 python3 tools/bench_train.py $S1 --steps 8 --warmup 3 --variant b16:$B16 --variant f8g:$F8,$G \
  --json $OUT/steps_S1.json 2>&1 | grep -v Warning | tail -4
echo "S1 $(( $(date +%s) - t0 )) s"
