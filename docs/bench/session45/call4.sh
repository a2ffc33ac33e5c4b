#!/usr/bin/env bash
# Session 45's call 4 (never ran: no machine came; queued for session 46). residual_gradcmp.py on the GPU
# (precision.bf16_residual's gradient error beside bf16's own and a rounding control's), then
# precision.bf16_residual off and on, compiled, on olmoe3-4l-8e (best / best_R / best_2). Unless SHORT=1
# (about 125 s, for a short budget), also: the GPU tests whose eager models take the Triton norm now that it
# is on by default (its own, the captured CUDA-graph step), OLMoE-8L compiled off / on, olmoe3-4l-8e eager
# off / on. Run from the repo root: [SHORT=1] bash docs/bench/session45/call4.sh (timeout 600; about 480 s warm)
source docs/bench/session32/switches.sh
export MOETRON_PYTHON=$(command -v python3)
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
R=precision.bf16_residual=true
run() {  # run NAME TIMEOUT SHAPE STEPS WARMUP VARIANT...: one bench_train call, its JSON under $OUT
  local name=$1 limit=$2 shape=$3 steps=$4 warmup=$5 t0=$(date +%s); shift 5
  timeout $limit python3 tools/bench_train.py $shape --steps $steps --warmup $warmup "${@/#/--variant=}" \
    --json $OUT/$name.json 2>&1 | grep -v Warning | tail -5
  echo "$name $(( $(date +%s) - t0 )) s"
}
timeout 40 python3 docs/bench/session45/residual_gradcmp.py cuda 16384 2>&1 | grep -v Warning | tail -5
if [[ "${SHORT:-0}" == 1 ]]; then
  run S2_residual 90 "$S2" 8 3 best:$BEST best_R:$BEST,$R
  exit
fi
t0=$(date +%s)
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/core/test_norm_triton.py \
  tests/core/test_cuda_graph.py::test_replayed_step_equals_eager_step_on_gpu 2>&1 | tail -2
echo "tests $(( $(date +%s) - t0 )) s"
run S2_residual 150 "$S2" 12 4 best:$BEST best_R:$BEST,$R best_2:$BEST
run S1_residual 90 "$S1" 12 4 best:$BEST best_R:$BEST,$R
run S2_eager_residual 60 "${S2/ --compile/}" 8 3 best:$BEST best_R:$BEST,$R
