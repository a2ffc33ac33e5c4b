#!/usr/bin/env bash
# Queued for session 39: #14's convergence check of native fp8_blockwise on today's defaults (the Gluon
# experts on SM90, the input quantized once since session 38, the optimizer's bf16 expert copies), last
# run on session 20-21's code: 300 steps of the GPU proxy (examples/pretrain_moe_1t.sh) on the embedded
# corpus, four runs sharing the GPU (about 17.5 GiB each; a fifth ran out of memory on an H100 in session
# 31). Compare with `python tools/compare_runs.py --group "bf16=bf16_s0,bf16_s1,bf16_s2" --group
# "fp8_blockwise=f8_s0,f8_s1,f8_s2" --tolerance 0.01` on the copied metrics.
# Run from the repo root: bash docs/bench/session38/call6.sh [BATCH...] (each batch about 150 s warm).
set -u
F8=--precision.recipe=fp8_blockwise,--precision.expert_weight_copies=optimizer,--precision.expert_grads_bf16=true
nvidia-smi --query-gpu=name --format=csv,noheader
batch() { timeout 400 bash docs/bench/session21/conv/conv.sh "$@" 2>&1 | grep -E "\[done\]|NVIDIA"; }
for b in ${@:-1 2}; do
  case $b in
    1) batch bf16_s0:--trainer.seed=0 f8_s0:$F8,--trainer.seed=0 f8_s1:$F8,--trainer.seed=1 f8_s2:$F8,--trainer.seed=2 ;;
    2) batch bf16_s1:--trainer.seed=1 bf16_s2:--trainer.seed=2 ;;
  esac
done
