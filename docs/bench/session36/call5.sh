#!/usr/bin/env bash
# Session 36's queued call 5 (not run: the device time ran out): the staged-scale Gluon wgrad's GPU tests
# (call 3's test step timed out before any result: the Gluon file alone first), both expert GEMMs with
# --loop 10 (call 3 was cut after gate|up), and whether OLMoE-8L's f8g step (0.970x bf16) waits on the host:
# its profile (busy share, GEMM / quantization / other) beside b16's, and the grouped fwd+bwd with the host's
# time hidden (bench_gemm_fp8 --loop 10: call 3's olmoe was 1.09x bf16 in kernel time, 0.83x in wall time).
# Run from the repo root: bash docs/bench/session36/call5.sh (timeout 600; at most about 530 s).
source docs/bench/session25/common.sh
F8=optimizer.state_dtype=bf16,precision.recipe=fp8_blockwise
G=precision.fp8_experts=gluon
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 90 python3 -m pytest -q -m gpu tests/core/test_fp8_gluon.py --tb=short 2>&1 | grep -v Warning | tail -8
echo "gluon tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 90 python3 -m pytest -q -m gpu tests/core/test_precision_fp8.py -k "gluon or fullgraph" --tb=short 2>&1 \
  | grep -v Warning | tail -8
echo "fp8 tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 100 python3 tools/bench_fp8_variants.py --shapes olmoe --gemms gate_up,down --iters 10 --loop 10 \
  --gluon-configs "4,1,1" --gluon-k-configs "4,1,1;4,1" --json $OUT/variants_loop10.json 2>&1 | grep -v Warning | tail -14
echo "variants $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 70 python3 tools/bench_gemm_fp8.py --iters 10 --loop 10 --skip-check --shapes olmoe olmo3-moe-3.2b --no-dense \
  --backends "fp8_blockwise gluon" --json $OUT/gemm_fp8_loop10.json 2>&1 | grep -v Warning | tail -8
echo "gemm_fp8 loop 10 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
for v in b16:$B16 f8g:$F8,$G; do
  name=${v%%:*}; over=${v#*:}
  timeout 90 python3 tools/profile_step.py $S1 $(echo "$over" | tr ',' '\n' | sed 's/^/--/' | tr '\n' ' ') \
    --wait 2 --warmup 1 --active 2 --top 12 --json $OUT/profile_S1_$name.json 2>&1 | grep -v Warning | tail -24
done
echo "profiles $(( $(date +%s) - t0 )) s"
