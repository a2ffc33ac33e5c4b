#!/usr/bin/env bash
# Session 45, call 4: model.triton_rmsnorm now on by default (the GPU tests whose eager models take it:
# the norm's own and the captured CUDA-graph step), then precision.bf16_residual (new: the residual
# stream in bf16 on one unsharded GPU, as FSDP2 makes it in sharded runs) on and off, compiled on both
# #13 shapes (olmoe3-4l-8e's best row before and after) and eager on olmoe3-4l-8e.
# Run from the repo root: bash docs/bench/session45/call4.sh (timeout 600; about 480 s warm)
source docs/bench/session32/switches.sh
export MOETRON_PYTHON=$(command -v python3)
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
R=precision.bf16_residual=true
t0=$(date +%s)
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/core/test_norm_triton.py \
  tests/core/test_cuda_graph.py::test_replayed_step_equals_eager_step_on_gpu 2>&1 | tail -2
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 150 python3 tools/bench_train.py $S2 --steps 12 --warmup 4 --variant best:$BEST --variant best_R:$BEST,$R \
  --variant best_2:$BEST --json $OUT/S2_residual.json 2>&1 | grep -v Warning | tail -6
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 90 python3 tools/bench_train.py $S1 --steps 12 --warmup 4 --variant best:$BEST --variant best_R:$BEST,$R \
  --json $OUT/S1_residual.json 2>&1 | grep -v Warning | tail -4
echo "S1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 60 python3 tools/bench_train.py ${S2/ --compile/} --steps 8 --warmup 3 --variant best:$BEST \
  --variant best_R:$BEST,$R --json $OUT/S2_eager_residual.json 2>&1 | grep -v Warning | tail -4
echo "S2 eager $(( $(date +%s) - t0 )) s"
