#!/usr/bin/env bash
# OLMoE-8L over 12 steps, b16 beside mxfp8 emulated in each MX tile order (MOETRON_MX_GRID, set per
# process), then cols-first with the fused kernel on 2 warps (call 1's best sum over the three operands).
# Run from the repo root through the device tool: bash docs/bench/session30/call2.sh (timeout 560).
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
MOETRON_MX_GRID=rows-first timeout 200 python3 tools/bench_train.py $S1 --steps 12 --warmup 3 --variant b16:$B16 \
  --variant mxcXI_r:$MXC,$X,$I --variant mxcXQI_r:$MXC,$X,$Q,$I --json $OUT/olmoe8l_rows.json 2>&1 \
  | grep -v Warning | tail -5
echo "rows-first $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
MOETRON_MX_GRID=cols-first timeout 200 python3 tools/bench_train.py $S1 --steps 12 --warmup 3 --variant b16b:$B16 \
  --variant mxcXI_c:$MXC,$X,$I --variant mxcXQI_c:$MXC,$X,$Q,$I --json $OUT/olmoe8l_cols.json 2>&1 \
  | grep -v Warning | tail -5
echo "cols-first $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
MOETRON_MX_GRID=cols-first MOETRON_MX_BOTH_TILE=128,2,tile-codes timeout 130 python3 tools/bench_train.py $S1 \
  --steps 12 --warmup 3 --variant mxcXI_c2:$MXC,$X,$I --json $OUT/olmoe8l_cols_w2.json 2>&1 | grep -v Warning | tail -3
echo "cols-first w2 $(( $(date +%s) - t0 )) s"
