#!/usr/bin/env bash
# Session 49: the SHE proxy runs (proxy_she.sh, seeds 0-2) against session 46's runs of the same seeds on today's
# default (bf16_residual on: call 5's s0_R, call 3's s1_R / s2_R), through the convergence check. Run from the
# repo root (CPU): bash docs/bench/session49/compare_she.sh
set -eu
T=/tmp/cmp_she; rm -rf $T; mkdir -p $T
cp1() { mkdir -p $T/$2; cp $1 $T/$2/metrics.jsonl; }
cp1 docs/bench/session46/call5/proxy_norm_s0_R.jsonl s0_R
cp1 docs/bench/session46/call3/proxy_norm_s1_R.jsonl s1_R
cp1 docs/bench/session46/call3/proxy_norm_s2_R.jsonl s2_R
D=docs/bench/session49/call4_5
for s in 0 1 2; do cp1 $D/proxy_norm_s${s}_SHE.jsonl s${s}_SHE; done
python tools/compare_runs.py --group default=$T/s0_R,$T/s1_R,$T/s2_R --group SHE=$T/s0_SHE,$T/s1_SHE,$T/s2_SHE \
  --json docs/bench/session49/compare_she.json
