#!/usr/bin/env bash
# Session 55, call 2: do the tiny-width step of docs/bench/session54/next.sh launch what OLMoE-8L's full-width
# default step launches? profile_step.py on both, same code, same machine: kernels a step by category
# (full_profile.json / tiny_profile.json, "kernels_per_step"), each one's idle table and host line.
# Run from the repo root: bash docs/bench/session55/kernel_counts.sh (timeout 300; about 55 s warm)
source docs/bench/session42/common.sh
TINY="--preset olmoe-1b-7b --model.n_layers=8 --model.vocab_size=1024 --model.d_model=128 --model.attention.n_heads=2
  --model.moe.expert_hidden=64 --seq-len 4096 --batch 4"
timeout 150 python3 tools/profile_step.py $S1 --compile --wait 1 --warmup 1 --active 2 --top 40 \
  --json $OUT/full_profile.json 2>&1 | grep -v Warning | tail -60
timeout 120 python3 tools/profile_step.py $TINY --compile --wait 1 --warmup 1 --active 2 --top 40 \
  --json $OUT/tiny_profile.json 2>&1 | grep -v Warning | tail -60
