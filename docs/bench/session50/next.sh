#!/usr/bin/env bash
# Queued by session 50 (not run: the device budget was spent): #13's real-text and eager rows for the new default
# (the weight copies' auto, on for one GPU and one micro-batch), as session 49's call3.sh took them for best + SHE:
# each shape compiled on random tokens and on the embedded corpus, and eager on random tokens, with the default
# and with the copies off beside it in the same process (10 timed steps after 3); then OLMoE-8L's profile on the
# default (its non-GEMM share at 16,384 tokens). SPLIT=1: instead, the default with and without optimizer.split_master
# (measured only with bf16 moments so far; with the copies now on by default it may take back their 2.6 / 5.5 GiB).
# Run from the repo root: bash docs/bench/session50/next.sh (timeout 600; about 450 s warm; SPLIT=1 about 150 s).
# ALT=name:overrides replaces the row beside the default (off:$OFF); NO_PROFILE=1 skips the profile (session 52's
# next.sh runs it so).
source docs/bench/session42/common.sh
OFF=precision.expert_weight_copies=none,precision.expert_grads_bf16=false,precision.dense_weight_copies=false,precision.head_weight_copy=false
if [[ -n "${SPLIT:-}" ]]; then
  for S in "$S2" "$S1"; do
    timeout 110 python3 tools/bench_train.py $S --steps 12 --warmup 4 --variant default: \
      --variant default_S:optimizer.split_master=true --variant default_2: \
      --json $OUT/split_$(echo "$S" | cut -d' ' -f2).json 2>&1 | grep -v Warning | tail -4
  done
  exit 0
fi
for S in "$S2" "$S1" "${S2/--compile/}" "${S1/--compile/}"; do
  for T in "" "--real-text"; do
    [[ "$S" != *--compile* && -n "$T" ]] && continue  # eager: random tokens only
    t0=$(date +%s)
    timeout 110 python3 tools/bench_train.py $S $T --steps 10 --warmup 3 --variant default: --variant "${ALT:-off:$OFF}" \
      --json $OUT/default_$(echo "$S" | cut -d' ' -f2)${T:+_real}$([[ "$S" == *--compile* ]] || echo _eager).json 2>&1 \
      | grep -v Warning | tail -3
    echo "$(echo "$S" | cut -d' ' -f2) ${T:-random} $([[ "$S" == *--compile* ]] && echo compiled || echo eager) $(( $(date +%s) - t0 )) s"
  done
done
[[ -n "${NO_PROFILE:-}" ]] || timeout 110 python3 tools/profile_step.py $S1 --wait 1 --warmup 1 --active 2 --top 12 --json $OUT/profile_S1_default.json \
  2>&1 | grep -v Warning | head -8
