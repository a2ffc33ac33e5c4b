#!/usr/bin/env bash
# Queued by session 52 (not run: machines were scarce and the budget was spent). SUITE=1: the whole GPU suite on the
# session's code (split_master auto by default, its guard; trainer.deterministic), which call 5 did not complete:
# bash docs/bench/session52/call3.sh. Otherwise: the new default on real text and eager beside split_master=false
# (session 50's next.sh loop: each shape compiled on random tokens and the embedded corpus, eager on random tokens;
# 10 timed steps after 3), then OLMoE-8L profiled with and without trainer.deterministic (where its 14% goes).
# Run from the repo root: SUITE=1 bash docs/bench/session52/next.sh (timeout 600; about 300-450 s), then
# bash docs/bench/session52/next.sh (timeout 600; about 450 s warm)
if [[ -n "${SUITE:-}" ]]; then
  exec bash docs/bench/session52/call3.sh
fi
ALT=nosplit:optimizer.split_master=false NO_PROFILE=1 bash docs/bench/session50/next.sh
source docs/bench/session42/common.sh
for D in false true; do
  timeout 110 python3 tools/profile_step.py $S1 --trainer.deterministic=$D --wait 1 --warmup 1 --active 2 --top 12 \
    --json $OUT/profile_S1_deterministic_$D.json 2>&1 | grep -v Warning | head -8
done
