#!/usr/bin/env bash
# Session 32's queued call 2 (not yet run). olmoe3-4l-8e: b16 against the dense copies, the dense and
# the head's copies, and those with the loss in two chunks of 8192 tokens and one of 16384 (fewer
# read-modify-writes of the fp32 grad_W; 1.6 / 3.3 GB of transient logits); then OLMoE-8L: b16, the
# prescale off, the dense and head copies, the Triton embedding gradient.
# Run from the repo root: bash docs/bench/session32/call2.sh (timeout 590; about 560 s warm-started).
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
DH=precision.dense_weight_copies=true,precision.head_weight_copy=true
P=model.fused_loss_prescale=false
t0=$(date +%s)
timeout 330 python3 tools/bench_train.py $S2 --steps 12 --warmup 3 --variant b16:$B16 \
  --variant b16D:$B16,precision.dense_weight_copies=true --variant b16DH:$B16,$DH \
  --variant b16DH_c8k:$B16,$DH,model.loss_chunk_tokens=8192 --variant b16DH_c16k:$B16,$DH,model.loss_chunk_tokens=16384 \
  --json $OUT/copies_chunks_S2.json 2>&1 | grep -v Warning | tail -7
echo "S2 $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 250 python3 tools/bench_train.py $S1 --steps 12 --warmup 3 --variant b16:$B16 --variant b16_noP:$B16,$P \
  --variant b16DH:$B16,$DH --variant b16E:$B16,model.triton_embedding_grad=true --json $OUT/switches_S1.json 2>&1 | grep -v Warning | tail -6
echo "S1 $(( $(date +%s) - t0 )) s"
