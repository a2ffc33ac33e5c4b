#!/usr/bin/env bash
# #14's convergence check rerun on the code where quantize_input_once=auto turns the switch on for
# mxfp8 emulated and fp8_rowwise (session 29) and the MX tiles run cols-first (session 30): 300 steps
# of the GPU proxy (examples/pretrain_moe_1t.sh) on the embedded corpus, runs sharing the GPU four at a
# time (each holds about 17.5 GiB: a fifth ran out of memory on the H100's 80 GB; the H200 takes 7).
# Session 31 ran batch 1 as call 4a (with four more runs that ran out of memory, rerun as batch 2 in
# call 4b), batch 3 as call 4c, batch 4 as call 5 (docs/performance.md, session 31).
# Run from the repo root: bash docs/bench/session31/call4.sh [BATCH...] (each batch about 150 s warm).
set -u
MXC=--precision.recipe=mxfp8,--precision.backend=emulated,--precision.expert_weight_copies=optimizer,--precision.expert_grads_bf16=true
RW=--precision.recipe=fp8_rowwise
nvidia-smi --query-gpu=name --format=csv,noheader
batch() { timeout 400 bash docs/bench/session21/conv/conv.sh "$@" 2>&1 | grep -E "\[done\]|NVIDIA"; }
for b in ${@:-1 2 3 4}; do
  case $b in
    1) batch bf16_s0:--trainer.seed=0 mxc_s1:$MXC,--trainer.seed=1 mxc_s2:$MXC,--trainer.seed=2 ;;
    2) batch mxc_s0:$MXC,--trainer.seed=0 rw_s0:$RW,--trainer.seed=0 rw_s1:$RW,--trainer.seed=1 rw_s2:$RW,--trainer.seed=2 ;;
    3) batch bf16_s1:--trainer.seed=1 bf16_s2:--trainer.seed=2 ;;
    4) batch bf16_s3:--trainer.seed=3 bf16_s4:--trainer.seed=4 mxc_s3:$MXC,--trainer.seed=3 mxc_s4:$MXC,--trainer.seed=4 ;;
  esac
done
