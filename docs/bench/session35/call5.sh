#!/usr/bin/env bash
# Session 35's queued call 5 (not yet run; the session's device time ran out): whole compiled steps
# with the Gluon kernels behind custom ops (call 4's f8g rows failed: Inductor cannot recompile a
# traced Gluon kernel), one process a shape, then the expert GEMMs timed on the GPU alone (--loop 10:
# call 2's cells include each call's host time, the Gluon launches' the largest).
# Then wgrad_probe.py: what the wgrad kernel's outer-product promotion and its fp32 store cost.
# Run from the repo root: bash docs/bench/session35/call5.sh (timeout 540; about 470 s warm-started).
source docs/bench/session25/common.sh
F8=optimizer.state_dtype=bf16,precision.recipe=fp8_blockwise
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 170 python3 tools/bench_train.py $S2 --steps 8 --warmup 3 --variant f8g:$F8,precision.fp8_experts=gluon \
  --variant b16:$B16 --variant f8:$F8 --json $OUT/steps_S2.json 2>&1 | grep -v Warning | tail -4
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 130 python3 tools/bench_train.py $S1 --steps 8 --warmup 3 --variant f8g:$F8,precision.fp8_experts=gluon \
  --variant b16:$B16 --json $OUT/steps_S1.json 2>&1 | grep -v Warning | tail -3
echo "S1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 100 python3 tools/bench_fp8_variants.py --shapes olmoe --gemms gate_up,down --iters 10 --loop 10 \
  --json $OUT/variants_loop10.json 2>&1 | grep -v Warning | tail -14
echo "variants $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 60 python3 docs/bench/session35/wgrad_probe.py 2>&1 | grep -v Warning | tail -20
echo "wgrad probe $(( $(date +%s) - t0 )) s"
