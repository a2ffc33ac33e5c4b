#!/usr/bin/env bash
# Session 34's call 6 (call 5 trimmed to the budget left): the warp-specialized FP8 kernels with
# 64-row tiles, their GPU tests and their speed beside the pipelined kernels and bf16, then the
# profile of olmoe3-4l-8e's best row (ALL + G + one 16,384-token loss chunk).
# Then the hand-written Gluon warp specialization probe (gluon_ws_probe.py).
# Run from the repo root: bash docs/bench/session34/call6.sh (timeout 300).
source docs/bench/session32/switches.sh
G=optimizer.triton_grad_norm=true
C=model.loss_chunk_tokens=16384
t0=$(date +%s)
timeout 80 python3 -m pytest -q -m gpu tests/core/test_precision_fp8.py -k "warp_specialized or triton_ws" 2>&1 | tail -3
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 60 python3 tools/bench_fp8_variants.py --ws --shapes olmoe --gemms gate_up --iters 10 \
  --json $OUT/variants.json 2>&1 | grep -v Warning | tail -10
echo "variants $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 60 python3 tools/profile_step.py $S2 --optimizer.state_dtype=bf16 --precision.expert_weight_copies=optimizer \
  --precision.expert_grads_bf16=true --$D --$H --$E --$S --$G --$C --wait 1 --warmup 1 --active 2 --top 12 \
  --json $OUT/profile_best.json 2>&1 | grep -v Warning | head -22
echo "profile $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 90 python3 docs/bench/session34/gluon_ws_probe.py 2>&1 | grep -v Warning | tail -14
echo "gluon probe $(( $(date +%s) - t0 )) s"
