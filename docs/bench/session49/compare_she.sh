#!/usr/bin/env bash
# Session 49: the SHE proxy runs (proxy_she.sh, seeds 0-2) against session 46's runs of the same seeds on today's
# default (bf16_residual on: call 5's s0_R, call 3's s1_R / s2_R), through the convergence check, which reads the
# saved metrics.jsonl files as they are. Run from the repo root (CPU): bash docs/bench/session49/compare_she.sh
set -eu
R=docs/bench/session46; D=docs/bench/session49/call4_5
python tools/compare_runs.py \
  --group default=$R/call5/proxy_norm_s0_R.jsonl,$R/call3/proxy_norm_s1_R.jsonl,$R/call3/proxy_norm_s2_R.jsonl \
  --group SHE=$D/proxy_norm_s0_SHE.jsonl,$D/proxy_norm_s1_SHE.jsonl,$D/proxy_norm_s2_SHE.jsonl \
  --json docs/bench/session49/compare_she.json
