#!/usr/bin/env bash
# The MX tiles' order on the GPU kind this call gets (session 30 measured it on an H100 only): the
# pair and the fused kernel in each order, then OLMoE-8L b16 / mxcXI in each order, one process per
# order, and mxcXQI (quantized expert copies) beside them in the cols-first process (#14's 0.9x).
# Run from the repo root: bash docs/bench/session31/call3.sh (timeout 590).
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 90 python3 tools/bench_optim.py --variants triton_bf16_copy,triton_bf16_mxpair --steps 5 --warmup 2 \
  --mx-tiles 128x8,64x8 --mx-order rows-first,cols-first --json $OUT/optim.json 2>&1 | grep -v Warn | tail -6
echo "optim $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 100 python3 tools/bench_quantize.py --mx --json $OUT/quantize_mx.json 2>&1 | grep -v Warn > $OUT/quantize_mx.txt
grep -E "copy|128 cols w4 tile-codes" $OUT/quantize_mx.txt
echo "quantize $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
MOETRON_MX_GRID=rows-first timeout 140 python3 tools/bench_train.py $S1 --steps 12 --warmup 3 \
  --variant b16_rows:$B16 --variant mxcXI_rows:$MXC,$X,$I --json $OUT/olmoe8l_rows-first.json 2>&1 \
  | grep -v Warning | tail -3
echo "rows-first $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
MOETRON_MX_GRID=cols-first timeout 170 python3 tools/bench_train.py $S1 --steps 12 --warmup 3 \
  --variant b16_cols:$B16 --variant mxcXI_cols:$MXC,$X,$I --variant mxcXQI_cols:$MXC,$X,$Q,$I \
  --json $OUT/olmoe8l_cols-first.json 2>&1 | grep -v Warning | tail -4
echo "cols-first $(( $(date +%s) - t0 )) s"
