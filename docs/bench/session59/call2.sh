#!/usr/bin/env bash
# Session 59's second call: the GPU proxy (examples/pretrain_moe_1t.sh: 200 steps, checkpoint at 100 and a resume
# in a new process) with optimizer.state_dtype=q8 against its default (fp32 moments), seeds 0 and 1, each run
# once (about 4 x 130 s). Then: python tools/compare_runs.py --group default=...s0_D,...s1_D --group q8=...
# Run from the repo root: bash docs/bench/session59/call2.sh (SEEDS="0" for two runs).
for seed in ${SEEDS:-0 1}; do
  PROXY_TIMEOUT=140 bash docs/bench/session44/proxy_runs.sh s${seed}_D:"--trainer.seed=$seed" \
    s${seed}_Q:"--trainer.seed=$seed --optimizer.state_dtype=q8"
done
