#!/usr/bin/env bash
# Session 45: model.triton_rmsnorm's proxy runs of sessions 44-45 through the convergence check, pooled and one
# run a seed (the JSON beside this script). Each metrics.jsonl gets a directory of its own under /tmp/cmp
# (named callN_FILE: session 44's call3 / call4, session 45's call3). Run from the repo root (CPU).
set -eu
T=/tmp/cmp; rm -rf $T; mkdir -p $T
for f in docs/bench/session44/call3/*.jsonl docs/bench/session44/call4/*.jsonl docs/bench/session45/call3/*.jsonl; do
  n=$(basename $(dirname $f))_$(basename $f .jsonl); mkdir -p $T/$n; cp $f $T/$n/metrics.jsonl
done
python tools/compare_runs.py \
  --group off=$T/call3_proxy_norm_off,$T/call3_proxy_norm_off2,$T/call4_proxy_norm_chunk,$T/call4_proxy_norm_gnorm,$T/call3_proxy_norm_s1_off,$T/call3_proxy_norm_s2_off \
  --group norm=$T/call3_proxy_norm_on,$T/call3_proxy_norm_onrope,$T/call4_proxy_norm_onchunk,$T/call3_proxy_norm_s1_on,$T/call3_proxy_norm_s2_on \
  --json docs/bench/session45/compare_norm_pooled.json
python tools/compare_runs.py --group off=$T/call3_proxy_norm_off,$T/call3_proxy_norm_s1_off,$T/call3_proxy_norm_s2_off \
  --group norm=$T/call3_proxy_norm_on,$T/call3_proxy_norm_s1_on,$T/call3_proxy_norm_s2_on \
  --json docs/bench/session45/compare_norm_per_seed.json
