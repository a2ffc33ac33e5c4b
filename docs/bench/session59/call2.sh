#!/usr/bin/env bash
# Session 59's second call (the budget's last ~350 s):
# 1. the q8 AdamW kernel's tile: rows x warps (core.adamw_triton.Q8_ROWS, Q8_WARPS) over OLMoE-8L's 3.77B
#    parameters, through tools/bench_optim.py's triton_q8 row (--block = rows x 256), one warps value a run;
# 2. the GPU proxy (examples/pretrain_moe_1t.sh: 200 steps, checkpoint at 100 and a resume in a new process) with
#    optimizer.state_dtype=q8 against its default (fp32 moments), seed 0 each (SEEDS="0 1" for two seeds).
# Run from the repo root: bash docs/bench/session59/call2.sh
source docs/bench/session25/common.sh
for warps in 2 4 8; do
  timeout 60 python3 -c "
import sys; sys.path.insert(0, 'tools')
import bench_optim, moetron.core.adamw_triton as K
K.Q8_WARPS = $warps
sys.exit(bench_optim.main(['--variants', 'triton_q8', '--block', '256,512,1024', '--steps', '5',
                           '--json', '$OUT/q8_tiles_w$warps.json']))" 2>&1 | grep triton_q8 | sed "s/^/warps $warps: /"
done
for seed in ${SEEDS:-0}; do
  PROXY_TIMEOUT=140 bash docs/bench/session44/proxy_runs.sh s${seed}_D:"--trainer.seed=$seed" \
    s${seed}_Q:"--trainer.seed=$seed --optimizer.state_dtype=q8"
done
