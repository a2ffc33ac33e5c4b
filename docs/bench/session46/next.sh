#!/usr/bin/env bash
# Queued for session 47 (any GPU, first; about 520 s on a fresh H100): the whole GPU suite on session 46's
# default (precision.bf16_residual=auto: the bf16 stream in every bf16 GPU test), then #13's non-GEMM share
# on olmoe3-4l-8e and OLMoE-8L with it (tools/profile_step.py, the best row, 40 kernels, as session 39's
# call 9 and session 41's OLMoE-8L profile), then native fp8_blockwise's f8gc row (#14's) with and without
# the bf16 stream (auto leaves it off there: not measured).
# Run from the repo root: bash docs/bench/session46/next.sh (timeout 600)
source docs/bench/session32/switches.sh
source docs/bench/session37/common.sh
export MOETRON_PYTHON=$(command -v python3)
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
t0=$(date +%s)
MOETRON_PYTHON=python3 MOETRON_TEST_WORKERS=3 timeout 330 bash tools/run_tests.sh -m gpu > $OUT/gpu_suite.txt 2>&1
tail -3 $OUT/gpu_suite.txt; echo "gpu suite $(( $(date +%s) - t0 )) s"
for shape in S2 S1; do
  t0=$(date +%s)
  timeout 100 python3 tools/profile_step.py ${!shape} $(echo "$BEST" | tr ',' '\n' | sed 's/^/--/' | tr '\n' ' ') \
    --wait 1 --warmup 1 --active 2 --top 40 --json $OUT/profile_${shape}_best_top40.json 2>&1 | grep -v Warning \
    | grep -E "step|non-GEMM|fused_pointwise|elementwise|norm|routing|loss|optimizer" | head -24
  echo "profile $shape $(( $(date +%s) - t0 )) s"
done
t0=$(date +%s)
timeout 100 python3 tools/bench_train.py $S2 --steps 12 --warmup 4 --variant f8gc:$F8,$G,$C \
  --variant f8gc_R:$F8,$G,$C,precision.bf16_residual=true --json $OUT/olmoe3_f8gc_residual.json 2>&1 | grep -v Warning | tail -4
echo "f8gc $(( $(date +%s) - t0 )) s"
