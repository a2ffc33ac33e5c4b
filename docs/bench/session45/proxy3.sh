#!/usr/bin/env bash
# Queued by session 44: model.triton_rmsnorm's default, with independent samples. Session 44's proxy runs that
# shared their first 10 steps ended close together (the early steps decide much: which experts starve), so
# its seven runs were five independent trajectories, the norm's two both above the three without it (p = 0.1
# by rank). Here two more seeds of the initial weights (trainer.seed; the data order, data.seed, kept), the norm off and on
# for each: with session 44's seed-0 runs, three pairs. Any GPU; about 320 s.
# Run from the repo root: bash docs/bench/session45/proxy3.sh (timeout 600)
source docs/bench/session25/common.sh
export MOETRON_PYTHON=$(command -v python3)
for seed in 1 2; do
  for on in false true; do
    name=s${seed}_$on
    t0=$(date +%s)
    RUN_DIR=runs/proxy_$name STEPS=200 timeout 130 bash examples/pretrain_moe_1t.sh --checkpoint.keep_last=1 \
      --trainer.seed=$seed --model.triton_rmsnorm=$on > $OUT/proxy_$name.log 2>&1
    echo "[$name] rc=$? $(( $(date +%s) - t0 )) s"
    cp runs/proxy_$name/metrics.jsonl $OUT/proxy_$name.jsonl 2>/dev/null
    grep -E "== summary|rror" $OUT/proxy_$name.log | head -3
  done
done
