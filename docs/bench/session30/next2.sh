#!/usr/bin/env bash
# The MX tiles' order on the other GPU kind (session 30 measured it on an H100 only): the pair and the
# fused kernel in each order, then OLMoE-8L b16 / mxcXI in each order, one process per order.
# Run from the repo root: bash docs/bench/session30/next2.sh (timeout 560).
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 90 python3 tools/bench_optim.py --variants triton_bf16_copy,triton_bf16_mxpair --steps 5 --warmup 2 \
  --mx-tiles 128x8,64x8 --mx-order rows-first,cols-first --json $OUT/optim.json 2>&1 | grep -v Warn | tail -6
echo "optim $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 120 python3 tools/bench_quantize.py --mx --json $OUT/quantize_mx.json 2>&1 | grep -v Warn > $OUT/quantize_mx.txt
grep -E "copy|128 cols w4 tile-codes" $OUT/quantize_mx.txt
echo "quantize $(( $(date +%s) - t0 )) s"
for order in rows-first cols-first; do
  t0=$(date +%s)
  MOETRON_MX_GRID=$order timeout 130 python3 tools/bench_train.py $S1 --steps 12 --warmup 3 \
    --variant b16_${order%%-*}:$B16 --variant mxcXI_${order%%-*}:$MXC,$X,$I --json $OUT/olmoe8l_$order.json 2>&1 \
    | grep -v Warning | tail -3
  echo "$order $(( $(date +%s) - t0 )) s"
done
