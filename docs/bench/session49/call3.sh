#!/usr/bin/env bash
# Session 49, call 3: the whole GPU suite (pytest -m gpu) on the bf16-stream default, not run whole since session 46
# made it the default (session 47's call2.sh, first half), three workers; then #13's real-text and eager rows of
# the best row with SHE (session 39's call8.sh form, 10 timed steps after 3): each shape compiled on random tokens
# and on the embedded corpus, and eager on random tokens.
# Run from the repo root: bash docs/bench/session49/call3.sh (timeout 600; about 560 s warm). SKIP_SUITE=1: rows only.
source docs/bench/session42/common.sh
export MOETRON_PYTHON=$(command -v python3)
SHE=optimizer.split_master=true,precision.head_grads_bf16=true,precision.embedding_weight_copy=true
t0=$(date +%s)
if [[ -z "${SKIP_SUITE:-}" ]]; then
  MOETRON_PYTHON=python3 MOETRON_TEST_WORKERS=3 timeout 330 bash tools/run_tests.sh -m gpu > $OUT/gpu_suite.txt 2>&1
  tail -3 $OUT/gpu_suite.txt; echo "gpu suite $(( $(date +%s) - t0 )) s"
  grep -E "FAILED|ERROR" $OUT/gpu_suite.txt | head -20
fi
for S in "$S2" "$S1" "${S2/--compile/}" "${S1/--compile/}"; do
  for T in "" "--real-text"; do
    [[ "$S" != *--compile* && -n "$T" ]] && continue  # eager: random tokens only
    t0=$(date +%s)
    timeout 100 python3 tools/bench_train.py $S $T --steps 10 --warmup 3 --variant best_SHE:$BEST,$SHE \
      --json $OUT/steps_$(echo "$S" | cut -d' ' -f2)${T:+_real}$([[ "$S" == *--compile* ]] || echo _eager).json 2>&1 \
      | grep -v Warning | tail -2
    echo "$(echo "$S" | cut -d' ' -f2) ${T:-random} $([[ "$S" == *--compile* ]] && echo compiled || echo eager) $(( $(date +%s) - t0 )) s"
  done
done
