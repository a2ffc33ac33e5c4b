#!/usr/bin/env bash
# Session 26's device call 2 (after call1.sh): OLMoE-8L b16 / mxcXI interleaved over 12 steps (#14's 0.9x:
# 0.899x over 6 steps in session 26), mxcXQI with the fastest MX-pair tile of a quick sweep (whether
# quantized_expert_copies pays once its kernel runs near the HBM floor), and the idle table of mxcXI.
# Run from the repo root through the device tool: bash docs/bench/session26/call2.sh (timeout 600).
source docs/bench/session25/common.sh
t0=$(date +%s)
timeout 90 python3 tools/bench_optim.py --variants triton_bf16_mxpair --steps 5 --warmup 2 \
  --mx-tiles 128x4,64x4,64x2,32x1,128x8,256x8,64x8,32x4 --json $OUT/optim.json 2>&1 | grep -v Warning | tail -11
echo "optim $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
# the fastest MX-pair tile of the sweep above, patched in for the mxcXQI row (bench_train runs its variants
# in-process): whether quantized_expert_copies pays once its kernel runs near the HBM floor
TILE=$(python3 -c "import json; r=min((r for r in json.load(open('$OUT/optim.json'))['rows'] if r.get('mx_tile') and 'ms' in r), key=lambda r: r['ms']); print(r['mx_tile'])" 2>/dev/null || echo 128x4)
echo "MX-pair tile for mxcXQI: $TILE"
timeout 220 python3 -c "
import runpy, sys; sys.path.insert(0, 'tools')
import moetron.core.adamw_triton as k
k.MX_PAIR_TILE_COLS, k.MX_PAIR_WARPS = (int(v) for v in '$TILE'.split('x'))
sys.argv = ['tools/bench_train.py'] + sys.argv[1:]
runpy.run_path('tools/bench_train.py', run_name='__main__')" $S1 --steps 12 --warmup 3 --variant b16:$B16 \
  --variant mxcXI:$MXC,$X,$I --variant mxcXQI:$MXC,$X,$Q,$I --variant b16b:$B16 --variant mxcXIb:$MXC,$X,$I \
  --json $OUT/olmoe8l.json 2>&1 | grep -v Warning | tail -7
echo "train s1 $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 100 python3 tools/profile_step.py $S1 --optimizer.state_dtype=bf16 --precision.expert_weight_copies=optimizer \
  --precision.expert_grads_bf16=true --precision.recipe=mxfp8 --precision.backend=emulated \
  --precision.emulated_save_x_bf16=true --precision.quantize_input_once=true --wait 3 --warmup 1 --active 2 --top 20 \
  --json $OUT/profile_olmoe8l_mxcXI.json 2>&1 | grep -v Warning | sed -n '/over 2 active/,$p' | head -50
echo "profile $(( $(date +%s) - t0 )) s"
