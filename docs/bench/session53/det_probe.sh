#!/usr/bin/env bash
# Session 53: where trainer.deterministic's 14% goes (session 52: 0.857x the default's tokens/s on OLMoE-8L).
# torch.use_deterministic_algorithms also turns on torch.utils.deterministic.fill_uninitialized_memory (every
# torch.empty is filled with NaN, a write pass per allocation). Two processes: the default beside deterministic
# (fill on, as trainer.deterministic runs today), then the same pair with the fill off; each OLMoE-8L, compiled,
# 10 timed steps after 3. Run from the repo root: bash docs/bench/session53/det_probe.sh (timeout 600; about 250 s)
# Ran on 2b308f6 (call 3). Since then trainer.deterministic turns the fill off itself (core/trainer.py
# use_deterministic), so on later code both processes measure it off.
source docs/bench/session42/common.sh
for FILL in True False; do
  t0=$(date +%s)
  timeout 140 python3 -c "
import sys, runpy, torch
sys.path.insert(0, 'tools')
torch.utils.deterministic.fill_uninitialized_memory = $FILL
sys.argv = ['tools/bench_train.py'] + sys.argv[1:]
runpy.run_path('tools/bench_train.py', run_name='__main__')
" $S1 --steps 10 --warmup 3 --variant default: --variant det:trainer.deterministic=true \
    --json $OUT/det_fill_$FILL.json 2>&1 | grep -v Warning | tail -3
  echo "fill_uninitialized_memory=$FILL $(( $(date +%s) - t0 )) s"
done
