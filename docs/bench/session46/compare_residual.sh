#!/usr/bin/env bash
# Session 46: precision.bf16_residual's GPU proxy runs (seeds 0-2: call 5's s0_R, call 3's s1_R / s2_R; call 3's
# s0_R stopped at step 190 and is left out) against the norm-on runs of the same seeds (session 44 call 3's
# proxy_norm_on, session 45 call 3's s1_on / s2_on, session 46 call 4's s0_on), through the convergence check.
# Each metrics.jsonl gets a directory of its own under /tmp/cmp_r. Run from the repo root (CPU).
set -eu
T=/tmp/cmp_r; rm -rf $T; mkdir -p $T
cp1() { mkdir -p $T/$2; cp $1 $T/$2/metrics.jsonl; }
cp1 docs/bench/session44/call3/proxy_norm_on.jsonl s0_on44
cp1 docs/bench/session46/call4/proxy_norm_s0_on.jsonl s0_on46
cp1 docs/bench/session45/call3/proxy_norm_s1_on.jsonl s1_on
cp1 docs/bench/session45/call3/proxy_norm_s2_on.jsonl s2_on
cp1 docs/bench/session46/call5/proxy_norm_s0_R.jsonl s0_R
cp1 docs/bench/session46/call3/proxy_norm_s1_R.jsonl s1_R
cp1 docs/bench/session46/call3/proxy_norm_s2_R.jsonl s2_R
python tools/compare_runs.py --group norm=$T/s0_on44,$T/s1_on,$T/s2_on --group residual=$T/s0_R,$T/s1_R,$T/s2_R \
  --json docs/bench/session46/compare_residual_per_seed.json
python tools/compare_runs.py --group norm=$T/s0_on44,$T/s0_on46,$T/s1_on,$T/s2_on --group residual=$T/s0_R,$T/s1_R,$T/s2_R \
  --json docs/bench/session46/compare_residual_pooled.json
