#!/usr/bin/env bash
# Session 36 call 1 (session 35 queued it as call 6; + the TMA-store epilogue, GluonConfig.tma_store): the expert GEMMs on the GPU alone (--loop 10: call 2's cells
# include each call's host time: is it why they sit below session 34's probe?; deeper rings: 5-6 stages fit the
# rows kernel's shared memory, 5 the wgrad's), wgrad_probe.py (what the Gluon
# wgrad's outer-product promotion and fp32 store cost), and fwd+bwd with quantization with the
# Gluon forward / dgrad and bf16 wgrads (#14's grouped target: >= 1.3x bf16, floor 1.1x), its checks
# first (each experts kind's autograd fwd / dgrad / wgrad against float64: the Gluon ops' first on a GPU).
# The Gluon GPU tests first (new: the experts compiled against eager).
# Run from the repo root: bash docs/bench/session36/call1.sh (timeout 450; about 360 s warm-started).
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 80 python3 -m pytest -q -m gpu tests/core/test_fp8_gluon.py --tb=short 2>&1 | grep -v Warning | tail -15
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 160 python3 tools/bench_fp8_variants.py --shapes olmoe --gemms gate_up,down --iters 10 --loop 10 \
  --gluon-configs "4,1;3,1;5,1;6,1;4,0;4,1,1;5,1,1;6,1,1" --gluon-k-configs "4,1;5,1;4,1,1;5,1,1" --json $OUT/variants_loop10.json 2>&1 | grep -v Warning | tail -20
echo "variants $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 90 python3 docs/bench/session35/wgrad_probe.py 2>&1 | grep -v Warning | tail -34
echo "wgrad probe $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 140 python3 tools/bench_gemm_fp8.py --iters 10 --shapes olmoe olmo3-moe-3.2b olmo3-moe-8e --no-dense \
  --backends "fp8_blockwise gluon" "fp8_blockwise gluon bf16-wgrad" "fp8_blockwise bf16-wgrad" \
  --json $OUT/gemm_fp8.json 2>&1 | grep -v Warning | tail -26
echo "gemm_fp8 $(( $(date +%s) - t0 )) s"
