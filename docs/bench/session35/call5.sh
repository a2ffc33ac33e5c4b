#!/usr/bin/env bash
# Session 35's call 5 (281 s of device time left): olmoe3-4l-8e's compiled steps with the Gluon kernels
# behind custom ops (call 4's f8g rows failed: Inductor cannot recompile a traced Gluon kernel), then
# b16 in the same process. Run from the repo root: bash docs/bench/session35/call5.sh (timeout 150).
source docs/bench/session25/common.sh
F8=optimizer.state_dtype=bf16,precision.recipe=fp8_blockwise
t0=$(date +%s)
timeout 140 python3 tools/bench_train.py $S2 --steps 6 --warmup 2 --variant f8g:$F8,precision.fp8_experts=gluon \
  --variant b16:$B16 --json $OUT/steps_S2.json 2>&1 | grep -v Warning | tail -3
echo "S2 $(( $(date +%s) - t0 )) s"
