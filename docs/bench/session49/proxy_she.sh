#!/usr/bin/env bash
# Session 49: #13's numerics check of sessions 47-48's switches together (SHE: optimizer.split_master,
# precision.head_grads_bf16, precision.embedding_weight_copy) on the GPU proxy (200 steps, eager, checkpoint and
# resume at 100) at trainer.seed 0, 1, 2, against session 46's runs of the same seeds on today's default
# (bf16_residual on), through tools/compare_runs.py (docs/bench/session49/compare_she.sh, CPU).
# head_grads_bf16 needs the head's copy (head_weight_copy): the first try without it was refused (call2/).
# optimizer.impl=triton is auto's choice on CUDA (split_master needs this package's AdamW): named, it changes nothing.
# Any GPU; about 300 s (about 100 s a run). Run from the repo root: bash docs/bench/session49/proxy_she.sh (timeout 600)
SHE="--precision.head_weight_copy=true --optimizer.impl=triton --optimizer.split_master=true --precision.head_grads_bf16=true --precision.embedding_weight_copy=true"
rm -rf runs/proxy_norm_s0_SHE runs/proxy_norm_s1_SHE runs/proxy_norm_s2_SHE
PROXY_TIMEOUT=${PROXY_TIMEOUT:-150} bash docs/bench/session44/proxy_runs.sh s0_SHE:"--trainer.seed=0 $SHE" \
  s1_SHE:"--trainer.seed=1 $SHE" s2_SHE:"--trainer.seed=2 $SHE"
