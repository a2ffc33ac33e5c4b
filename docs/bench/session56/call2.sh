#!/usr/bin/env bash
# Session 56, call 2 (an H200): OLMoE-8L's best + SHE profile on the routing change (call 1 profiled the default),
# then the whole GPU suite on today's code (session 52's call3.sh).
# Run from the repo root: bash docs/bench/session56/call2.sh (timeout 600; about 420 s on a warm machine).
source docs/bench/session42/common.sh
O=$(flags "$BEST,$SHE")
timeout 140 python3 tools/profile_step.py $S1 $O --wait 1 --warmup 1 --active 2 --top 60 \
  --json $OUT/profile_S1_best_SHE.json 2>&1 | grep -v Warning | grep -E "active steps|^(routing|optimizer|other) |share"
bash docs/bench/session52/call3.sh
