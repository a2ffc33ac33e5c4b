#!/usr/bin/env bash
# Session 33's one call for what budget was left (about 700 s after failed starts): the decisive
# parts of call_ws1.sh and call_gn.sh. The GPU tests of precision.fp8_experts=triton_ws and
# optimizer.triton_grad_norm; the warp-specialized kernels per pass beside bf16 and the pipelined
# ones (olmoe's gate|up; olmo3-moe-8e's); fwd+bwd with quantization; the norm alone; then
# olmoe3-4l-8e b16 / b16 + the Triton norm. Run from the repo root: bash docs/bench/session33/call_mix.sh
source docs/bench/session25/common.sh
G=optimizer.triton_grad_norm=true
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 110 python3 -m pytest -q -m gpu tests/core/test_precision_fp8.py tests/core/test_grad_norm_triton.py \
  -k "warp_specialized or triton_ws or gpu_matches_float64_and_the_foreach" 2>&1 | tail -4
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 100 python3 tools/bench_fp8_variants.py --ws --shapes olmoe,olmo3-moe-8e --gemms gate_up --iters 10 \
  --json $OUT/variants.json 2>&1 | grep -v Warning | tail -16
echo "variants $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 80 python3 tools/bench_gemm_fp8.py --skip-check --iters 10 --no-dense --shapes olmoe olmo3-moe-8e \
  --backends fp8_blockwise "fp8_blockwise triton_ws" --json $OUT/gemm.json 2>&1 | grep -v Warning | tail -10
echo "gemm $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 45 python3 tools/bench_optim.py --variants norm_foreach,norm_triton --steps 10 --json $OUT/norm.json 2>&1 \
  | grep -v Warning | tail -4
echo "norm $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 120 python3 tools/bench_train.py $S2 --steps 10 --warmup 3 --variant b16:$B16 --variant b16G:$B16,$G \
  --json $OUT/gn_S2.json 2>&1 | grep -v Warning | tail -4
echo "S2 $(( $(date +%s) - t0 )) s"
