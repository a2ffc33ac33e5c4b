#!/usr/bin/env bash
# Session 60's second call: the GPU proxy (examples/pretrain_moe_1t.sh: 200 steps, a checkpoint at 100 and a resume
# in a new process) with its default moments, with optimizer.state_dtype=q8 and with optimizer.state_dtype=fp8, seed 0
# each (SEEDS="0 1" for two seeds; about 130 s a run; the proxy's run-to-run noise is 1.4%, session 51): the numerics
# check an 8-bit state needs before it could be a default.
# Run from the repo root: bash docs/bench/session60/call2.sh (about 420 s fresh).
source docs/bench/session25/common.sh
for seed in ${SEEDS:-0}; do
  PROXY_TIMEOUT=140 bash docs/bench/session44/proxy_runs.sh s${seed}_D:"--trainer.seed=$seed" \
    s${seed}_Q:"--trainer.seed=$seed --optimizer.state_dtype=q8" \
    s${seed}_F:"--trainer.seed=$seed --optimizer.state_dtype=fp8"
done
