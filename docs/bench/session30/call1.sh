#!/usr/bin/env bash
# The MX kernels' tile order (mx_triton.GRID_COLS_FIRST, new): the GPU tests of both orders, then
# the MX-pair optimizer kernel and the fused rows + columns kernel in each order beside a plain copy.
# Run from the repo root through the device tool: bash docs/bench/session30/call1.sh (timeout 420).
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 150 python3 -m pytest -q -m gpu tests/core/test_adamw_triton.py \
  "tests/core/test_precision_emulated.py::test_rows_and_cols_tiles_match_the_torch_ops_on_gpu" 2>&1 | tail -2
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 150 python3 tools/bench_optim.py --variants triton_bf16_copy,triton_bf16_mxpair --steps 5 --warmup 2 \
  --mx-tiles 128x8,64x4,32x4 --mx-order rows-first,cols-first --json $OUT/optim.json 2>&1 | grep -v Warn | tail -9
echo "optim $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 120 python3 tools/bench_quantize.py --mx --json $OUT/quantize_mx.json 2>&1 | grep -v Warn > $OUT/quantize_mx.txt
grep -E "copy|128 cols w4 tile-codes|256 cols w4 tile-codes|64 cols w4 |128 cols w2 tile" $OUT/quantize_mx.txt
echo "quantize $(( $(date +%s) - t0 )) s"
