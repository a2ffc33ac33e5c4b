#!/usr/bin/env bash
# Session 35's call 5: call 4's steps again with the Gluon kernels behind custom ops (call 4's f8g rows
# failed: Inductor cannot recompile a traced Gluon kernel). One process a shape.
# Run from the repo root: bash docs/bench/session35/call5.sh (timeout 300).
source docs/bench/session25/common.sh
F8=optimizer.state_dtype=bf16,precision.recipe=fp8_blockwise
t0=$(date +%s)
timeout 150 python3 tools/bench_train.py $S2 --steps 8 --warmup 3 --variant b16:$B16 --variant f8g:$F8,precision.fp8_experts=gluon \
  --variant f8:$F8 --json $OUT/steps_S2.json 2>&1 | grep -v Warning | tail -4
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 125 python3 tools/bench_train.py $S1 --steps 8 --warmup 3 --variant b16:$B16 --variant f8g:$F8,precision.fp8_experts=gluon \
  --json $OUT/steps_S1.json 2>&1 | grep -v Warning | tail -3
echo "S1 $(( $(date +%s) - t0 )) s"
