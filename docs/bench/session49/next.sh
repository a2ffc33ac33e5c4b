#!/usr/bin/env bash
# Queued by session 49 (not run): #13's OLMoE-8L non-GEMM, non-attention share against tokens a step. At 16,384 it
# is 31.3% (session 48), above the 15% target because the optimizer's pass (about 18 B a parameter over 3.77B) and
# the top-8 routing and pointwise kernels are near their HBM floors; the optimizer's share should halve with each
# doubling of the tokens. Profiles best + SHE at 4 and 8 sequences of 4096 (8 may need the H200's memory: its
# row says so if it does not fit). Run from the repo root: bash docs/bench/session49/next.sh (timeout 600; about 250 s)
source docs/bench/session42/common.sh
# First: the embedding's GPU tests (session 49's review merged its two autograd Functions into _GatherEmbedding
# after the device budget was spent: the Triton gradient of triton_embedding_grad and of embedding_weight_copy)
timeout 150 python3 -m pytest -q -m gpu tests/core/test_embedding.py tests/core/test_dense_copies.py 2>&1 | tail -3
SHE=optimizer.split_master=true,precision.head_grads_bf16=true,precision.embedding_weight_copy=true
for B in 4 8; do
  timeout 150 python3 tools/profile_step.py ${S1/--batch 4/--batch $B} \
    $(echo "$BEST,$SHE" | tr ',' '\n' | sed 's/^/--/' | tr '\n' ' ') --wait 1 --warmup 1 --active 2 --top 20 \
    --json $OUT/profile_S1_b${B}_best_SHE.json 2>&1 | grep -v Warning | grep -E "step|non-GEMM|optimizer|routing|fused_pointwise|error" | head -12
done
