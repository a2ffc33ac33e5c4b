#!/usr/bin/env bash
# Session 45, call 4 cut to the device time left (about 600 s with a fresh machine's start): call4.sh's
# precision.bf16_residual rows on both #13 shapes compiled first, then the GPU tests whose eager models now
# take the Triton norm by default (its own, and the captured CUDA-graph step).
# Run from the repo root: bash docs/bench/session45/call4b.sh (timeout 310)
source docs/bench/session32/switches.sh
export MOETRON_PYTHON=$(command -v python3)
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
R=precision.bf16_residual=true
t0=$(date +%s)
timeout 125 python3 tools/bench_train.py $S2 --steps 12 --warmup 4 --variant best:$BEST --variant best_R:$BEST,$R \
  --json $OUT/S2_residual.json 2>&1 | grep -v Warning | tail -4
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 95 python3 tools/bench_train.py $S1 --steps 12 --warmup 4 --variant best:$BEST --variant best_R:$BEST,$R \
  --json $OUT/S1_residual.json 2>&1 | grep -v Warning | tail -4
echo "S1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 80 python3 -m pytest -q -m gpu -p no:cacheprovider tests/core/test_norm_triton.py \
  tests/core/test_cuda_graph.py::test_replayed_step_equals_eager_step_on_gpu 2>&1 | tail -2
echo "tests $(( $(date +%s) - t0 )) s"
