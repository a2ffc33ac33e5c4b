#!/usr/bin/env bash
# Session 50: the GPU proxy on the new default (the weight copies auto, on there: call 4's s0_A / s1_A) against
# session 46's default runs of the same seeds (call 5's s0_R, call 3's s1_R), through the convergence check.
# Run from the repo root (CPU): bash docs/bench/session50/compare_auto.sh
set -eu
R=docs/bench/session46; D=docs/bench/session50/call4
python tools/compare_runs.py \
  --group default_46=$R/call5/proxy_norm_s0_R.jsonl,$R/call3/proxy_norm_s1_R.jsonl \
  --group auto_copies=$D/proxy_norm_s0_A.jsonl,$D/proxy_norm_s1_A.jsonl \
  --json docs/bench/session50/compare_auto.json
