#!/usr/bin/env bash
# Session 33's queued call for optimizer.triton_grad_norm (core/grad_norm_triton.py: the clipping norm's
# squares in one Triton reduction a gradient, instead of torch's _foreach_norm; built in session 33,
# never run on a GPU): its GPU test, then compiled steps of both #13 shapes, b16 / b16 + G / b16
# again, OLMoE-8L also mxfp8 emulated with and without G (12 steps each; session 31's olmoe3-4l-8e
# profile put the foreach norm at 3.3 ms of kernels and 0.25 ms of gaps a step, about 0.8 ms over one
# read of the gradients). Then the profile of olmoe3-4l-8e with G (its optimizer category against
# session 31's call6). Run from the repo root: bash docs/bench/session33/call_gn.sh (timeout 590;
# about 480 s warm-started).
source docs/bench/session25/common.sh
G=optimizer.triton_grad_norm=true
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 60 python3 -m pytest -q -m gpu tests/core/test_grad_norm_triton.py 2>&1 | tail -2
echo "tests $(( $(date +%s) - t0 )) s"
# the norm alone over OLMoE-8L's 3.77B fp32 gradients (tools/bench_optim.py: GB/s and x its one-read floor)
t0=$(date +%s)
timeout 90 python3 tools/bench_optim.py --variants norm_foreach,norm_triton --steps 10 --json $OUT/norm.json 2>&1 \
  | grep -v Warning | tail -4
echo "norm $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 160 python3 tools/bench_train.py $S2 --steps 12 --warmup 3 --variant b16:$B16 --variant b16G:$B16,$G \
  --variant b16_again:$B16 --json $OUT/gn_S2.json 2>&1 | grep -v Warning | tail -5
echo "S2 $(( $(date +%s) - t0 )) s"
# OLMoE-8L also with mxfp8 emulated (#14's 0.9x, met by a hair or missed by one: session 29 / 30)
t0=$(date +%s)
timeout 260 python3 tools/bench_train.py $S1 --steps 12 --warmup 3 --variant b16:$B16 --variant b16G:$B16,$G \
  --variant mx:$MXC,$X,$I --variant mxG:$MXC,$X,$I,$G --variant b16_again:$B16 --json $OUT/gn_S1.json 2>&1 \
  | grep -v Warning | tail -7
echo "S1 $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 100 python3 tools/profile_step.py $S2 --optimizer.state_dtype=bf16 --precision.expert_weight_copies=optimizer \
  --precision.expert_grads_bf16=true --$G --wait 1 --warmup 1 --active 2 --top 12 --json $OUT/profile_S2_G.json 2>&1 \
  | grep -v Warning | head -24
echo "profile $(( $(date +%s) - t0 )) s"
