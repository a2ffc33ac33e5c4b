#!/usr/bin/env bash
# Session 36 call 2 (session 35's call 5, never run): whole compiled steps
# with the Gluon kernels behind custom ops (call 4's f8g rows failed: Inductor cannot recompile a
# traced Gluon kernel), also with the experts' wgrads in bf16 (precision.fp8_wgrad=dense: the FP8
# wgrad kernels run 0.6-0.7x bf16's), one process a shape (#14: fp8_blockwise >= 1.3x bf16 on
# olmoe3-4l-8e, >= 1.15x on OLMoE-8L).
# Run from the repo root: bash docs/bench/session36/call2.sh (timeout 480; about 400 s warm-started).
source docs/bench/session25/common.sh
F8=optimizer.state_dtype=bf16,precision.recipe=fp8_blockwise
G=precision.fp8_experts=gluon
WD=precision.fp8_wgrad=dense
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 220 python3 tools/bench_train.py $S2 --steps 8 --warmup 3 --variant f8g:$F8,$G --variant f8gD:$F8,$G,$WD \
  --variant b16:$B16 --variant f8:$F8 --json $OUT/steps_S2.json 2>&1 | grep -v Warning | tail -5
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 180 python3 tools/bench_train.py $S1 --steps 8 --warmup 3 --variant f8g:$F8,$G --variant f8gD:$F8,$G,$WD \
  --variant b16:$B16 --json $OUT/steps_S1.json 2>&1 | grep -v Warning | tail -4
echo "S1 $(( $(date +%s) - t0 )) s"
