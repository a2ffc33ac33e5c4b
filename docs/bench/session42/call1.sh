#!/usr/bin/env bash
# Queued by session 41. Both best rows profiled on whatever GPU comes (on an H200: the GEMM tables that
# GPU.gemm_eff's H200 figure lacks, and its optimizer and attention times beside the planner's terms), then
# olmoe3-4l-8e's best row with a chrome trace of one step (--trace, gzipped) to read where the host falls
# behind the GPU (3.1 ms of GPU idle a step on the H100: block 0's first compiled kernel, the embedding
# gradient's copy_, fills in the compiled backward and the fused loss; session 41 call 3).
# Run from the repo root: bash docs/bench/session42/call1.sh (timeout 600; about 250 s on a fresh machine).
source docs/bench/session32/switches.sh
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
FLAGS=$(echo "$BEST" | tr ',' '\n' | sed 's/^/--/' | tr '\n' ' ')
for s in S1 S2; do
  t0=$(date +%s)
  timeout 150 python3 tools/profile_step.py ${!s} $FLAGS --wait 1 --warmup 1 --active 2 --top 12 \
    --json $OUT/profile_${s}_best.json 2>&1 | grep -v Warning | grep -E 'ms wall|non-GEMM, non-attention share' | head -3
  echo "$s $(( $(date +%s) - t0 )) s"
done
t0=$(date +%s)
timeout 150 python3 tools/profile_step.py $S2 $FLAGS --wait 1 --warmup 1 --active 1 --top 5 --trace $OUT/step_S2_best.json \
  2>&1 | grep -v Warning | tail -3
gzip -9 $OUT/step_S2_best.json 2>/dev/null; ls -la $OUT
echo "trace $(( $(date +%s) - t0 )) s"
