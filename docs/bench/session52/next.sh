#!/usr/bin/env bash
# Queued by session 52 (not run: machines were scarce and the budget was spent). SUITE=1: the whole GPU suite on the
# session's code (split_master auto by default, its guard; trainer.deterministic), which call 5 did not complete:
# bash docs/bench/session52/call3.sh. Otherwise: the new default on real text and eager beside split_master=false
# (each shape compiled on random tokens and the embedded corpus, eager on random tokens; 10 timed steps after 3), then
# OLMoE-8L profiled with and without trainer.deterministic (where its 14% goes).
# Run from the repo root: SUITE=1 bash docs/bench/session52/next.sh (timeout 600; about 300-450 s), then
# bash docs/bench/session52/next.sh (timeout 600; about 450 s warm)
if [[ -n "${SUITE:-}" ]]; then
  exec bash docs/bench/session52/call3.sh
fi
source docs/bench/session42/common.sh
NS=optimizer.split_master=false
for S in "$S2" "$S1" "${S2/--compile/}" "${S1/--compile/}"; do
  for T in "" "--real-text"; do
    [[ "$S" != *--compile* && -n "$T" ]] && continue  # eager: random tokens only
    t0=$(date +%s)
    timeout 110 python3 tools/bench_train.py $S $T --steps 10 --warmup 3 --variant default: --variant nosplit:$NS \
      --json $OUT/default_$(echo "$S" | cut -d' ' -f2)${T:+_real}$([[ "$S" == *--compile* ]] || echo _eager).json 2>&1 \
      | grep -v Warning | tail -3
    echo "$(echo "$S" | cut -d' ' -f2) ${T:-random} $([[ "$S" == *--compile* ]] && echo compiled || echo eager) $(( $(date +%s) - t0 )) s"
  done
done
for D in false true; do
  timeout 110 python3 tools/profile_step.py $S1 --trainer.deterministic=$D --wait 1 --warmup 1 --active 2 --top 12 \
    --json $OUT/profile_S1_deterministic_$D.json 2>&1 | grep -v Warning | head -8
done
