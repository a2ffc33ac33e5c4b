#!/usr/bin/env bash
# Session 35's call 3: whole compiled steps of both #13 shapes, bf16 / fp8_blockwise (the pipelined
# Triton experts) / fp8_blockwise on the warp-specialized Gluon experts / bf16 again, one process a
# shape (#14: fp8_blockwise >= 1.3x bf16 on olmoe3-4l-8e, >= 1.15x on OLMoE-8L).
# Run from the repo root: bash docs/bench/session35/call3.sh (timeout 590; about 480 s warm-started).
source docs/bench/session25/common.sh
F8=optimizer.state_dtype=bf16,precision.recipe=fp8_blockwise  # native: no optimizer expert copies (check_expert_copies)
nvidia-smi --query-gpu=name --format=csv,noheader
for shape in S2 S1; do
  t0=$(date +%s)
  timeout 270 python3 tools/bench_train.py ${!shape} --steps 8 --warmup 3 --variant b16:$B16 --variant f8:$F8 \
    --variant f8g:$F8,precision.fp8_experts=gluon --variant b16_again:$B16 \
    --json $OUT/steps_$shape.json 2>&1 | grep -v Warning | tail -6
  echo "$shape $(( $(date +%s) - t0 )) s"
done
