#!/usr/bin/env bash
# Queued for session 40: #13's real-text check on today's best row (last measured in session 17, on the
# H200, with B16): each shape's best row on random tokens and on the embedded corpus (routing that depends
# on the data), 10 timed steps after 3; and each shape's best row eager, beside the compiled ones.
# Run from the repo root: bash docs/bench/session39/call8.sh (timeout 600; about 400 s warm)
source docs/bench/session32/switches.sh
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
# eager beside compiled in the same call (#13): the compiled rows' shapes without --compile
for S in "$S1" "$S2" "${S1/--compile/}" "${S2/--compile/}"; do
  for T in "" "--real-text"; do
    [[ "$S" != *--compile* && -n "$T" ]] && continue  # eager: random tokens only
    t0=$(date +%s)
    timeout 140 python3 tools/bench_train.py $S $T --steps 10 --warmup 3 --variant best:$BEST \
      --json $OUT/steps_$(echo "$S" | cut -d' ' -f2)${T:+_real}$([[ "$S" == *--compile* ]] || echo _eager).json 2>&1 \
      | grep -v Warning | tail -2
    echo "$(echo "$S" | cut -d' ' -f2) ${T:-random} $([[ "$S" == *--compile* ]] && echo compiled || echo eager) $(( $(date +%s) - t0 )) s"
  done
done
