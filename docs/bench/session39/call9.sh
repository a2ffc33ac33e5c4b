#!/usr/bin/env bash
# Queued for session 40: trainer.cuda_graph on the GPU proxy of examples/pretrain_moe_1t.sh (one GPU, eager,
# d_model 768, 16,384 tokens a step: short kernels, where calls 5's batch-1 row gained 8.6%), end to end:
# the capture after two steps, evaluation and the half-way checkpoint after it, the resumed process
# capturing again. 60 steps without and with the graph, one after the other; the last log lines and the
# summary of each (tokens/s from the log; the two losses should agree closely, not bit for bit: the eager
# step itself is not reproducible at full size, session 39 call 3).
# Then olmoe3-4l-8e's best-row profile with 40 kernels listed.
# Run from the repo root: bash docs/bench/session39/call9.sh (timeout 600; about 280 s)
source docs/bench/session25/common.sh
export MOETRON_PYTHON=$(command -v python3)
for v in plain graph; do
  extra=(); [ $v = graph ] && extra=(--trainer.cuda_graph=true)
  t0=$(date +%s)
  STEPS=60 RUN_DIR=/tmp/proxy_$v timeout 250 bash examples/pretrain_moe_1t.sh --checkpoint.keep_last=1 "${extra[@]}" \
    > $OUT/proxy_$v.log 2>&1
  echo "[$v] rc=$? $(( $(date +%s) - t0 )) s"
  grep -E "tok/s" $OUT/proxy_$v.log | tail -3
  grep -E "== summary|rror" $OUT/proxy_$v.log | head -5
  cp /tmp/proxy_$v/metrics.jsonl $OUT/proxy_$v.jsonl 2>/dev/null
done
# olmoe3-4l-8e's best row with the whole kernel list (--top 40): which of the 13.3 ms of fused pointwise
# kernels are the routed SwiGLU's (swiglu_gemm_probe's lever) and which the blocks' own
source docs/bench/session32/switches.sh
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
t0=$(date +%s)
timeout 120 python3 tools/profile_step.py $S2 $(echo "$BEST" | tr ',' '\n' | sed 's/^/--/' | tr '\n' ' ') \
  --wait 1 --warmup 1 --active 2 --top 40 --json $OUT/profile_S2_best_top40.json 2>&1 | grep -v Warning | grep -E "fused_pointwise|elementwise|norm|routing|loss" | head -30
echo "profile $(( $(date +%s) - t0 )) s"
