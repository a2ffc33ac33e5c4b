#!/usr/bin/env bash
# Session 51: the GPU proxy (examples/pretrain_moe_1t.sh, 200 steps, resume at 100) with optimizer.split_master on
# top of the weight copies' auto (calls 3-4: s0_S, s1_S, s2_S; s1_S2 the seed-1 run again, same config) against the
# copies alone (session 50 call 4's s0_A, s1_A; call 4's s2_A), through the convergence check.
# Run from the repo root (CPU): bash docs/bench/session51/compare_split.sh
set -eu
A=docs/bench/session50/call4; B=docs/bench/session51
python tools/compare_runs.py \
  --group copies_auto=$A/proxy_norm_s0_A.jsonl,$A/proxy_norm_s1_A.jsonl,$B/call4/proxy_norm_s2_A.jsonl \
  --group split=$B/call3/proxy_norm_s0_S.jsonl,$B/call3/proxy_norm_s1_S.jsonl,$B/call4/proxy_norm_s2_S.jsonl \
  --group split_seed1_rerun=$B/call3/proxy_norm_s0_S.jsonl,$B/call4/proxy_norm_s1_S2.jsonl,$B/call4/proxy_norm_s2_S.jsonl \
  --group seed1_split_twice=$B/call3/proxy_norm_s1_S.jsonl,$B/call4/proxy_norm_s1_S2.jsonl \
  --json $B/compare_split.json
