#!/usr/bin/env bash
# Session 26, device call 1 (after session25/next_call.sh and session24/next_call2.sh ran): the GPU tests
# of the fused MX kernel session 25 refactored and of fp8_rowwise; the MX-pair kernel's tile sweep
# (it ran at 2971 GB/s against the plain copy's 4132); olmoe3-4l-8e rows; OLMoE-8L b16 / mxcXI
# interleaved over 12 steps (0.899x in next_call.sh, 6 steps), and mxcXQI with the sweep's best tile.
# Run from the repo root through the device tool: bash docs/bench/session26/call1.sh (timeout 600).
source docs/bench/session25/common.sh
t0=$(date +%s)
# -v into a file: a test the timeout stops still leaves the ones before it (session25/next_call.sh's
# emulated -k quantized pair ran out of its 90 s compiling and printed nothing)
timeout 120 python3 -m pytest -v -m gpu tests/core/test_fp8_rowwise.py tests/core/test_precision_emulated.py \
  tests/core/test_mx.py > $OUT/gpu_tests.txt 2>&1
grep -E "^E |PASSED|FAILED|ERROR|passed|failed" $OUT/gpu_tests.txt | sed 's/^tests.core.//' | cut -c1-110 | head -30
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 80 python3 tools/bench_optim.py --variants triton_bf16_copy,triton_bf16_mxpair --steps 5 --warmup 2 \
  --mx-tiles 128x4,64x4,64x2,32x1,128x8,256x8,64x8,32x4 --json $OUT/optim.json 2>&1 | grep -v Warning | tail -12
echo "optim $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 150 python3 tools/bench_train.py $S2 --steps 6 --warmup 3 --variant b16:$B16 --variant mxcX:$MXC,$X \
  --variant mxcXI:$MXC,$X,$I --variant f8rfc:$F8RFC --variant f8rfcI:$F8RFC,$I --json $OUT/olmoe3.json 2>&1 \
  | grep -v Warning | tail -7
echo "train s2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
# the fastest MX-pair tile of the sweep above, patched in for the mxcXQI row (bench_train runs its variants
# in-process): whether quantized_expert_copies pays once its kernel runs near the HBM floor
TILE=$(python3 -c "import json; r=min((r for r in json.load(open('$OUT/optim.json'))['rows'] if r.get('mx_tile') and 'ms' in r), key=lambda r: r['ms']); print(r['mx_tile'])" 2>/dev/null || echo 128x4)
echo "MX-pair tile for mxcXQI: $TILE"
timeout 170 python3 -c "
import runpy, sys; sys.path.insert(0, 'tools')
import moetron.core.adamw_triton as k
k.MX_PAIR_TILE_COLS, k.MX_PAIR_WARPS = (int(v) for v in '$TILE'.split('x'))
sys.argv = ['tools/bench_train.py'] + sys.argv[1:]
runpy.run_path('tools/bench_train.py', run_name='__main__')" $S1 --steps 12 --warmup 3 --variant b16:$B16 \
  --variant mxcXI:$MXC,$X,$I --variant mxcXQI:$MXC,$X,$Q,$I --variant b16b:$B16 --variant mxcXIb:$MXC,$X,$I \
  --json $OUT/olmoe8l.json 2>&1 | grep -v Warning | tail -7
echo "train s1 $(( $(date +%s) - t0 )) s"
