#!/usr/bin/env bash
# Session 50, call 2 (.peers carried): what a user gets without #13's switches. Both shapes, compiled, 16,384
# tokens a step, torchtitan 0.3.0 after each in the same run: the defaults; BITS, the switches that give the same
# bits as the defaults with one micro-batch on one unsharded GPU (the optimizer's bf16 expert copies and their
# bf16 gradients, the dense and head copies: the candidates for an automatic default); b16 (adds bf16 Adam
# moments, a numerics change); the best row; best + SHE.
# Run from the repo root: bash docs/bench/session50/call2.sh (timeout 600; about 330 s warm).
source docs/bench/session42/common.sh
BITS=precision.expert_weight_copies=optimizer,precision.expert_grads_bf16=true,precision.dense_weight_copies=true,precision.head_weight_copy=true
SHE=optimizer.split_master=true,precision.head_grads_bf16=true,precision.embedding_weight_copy=true
t0=$(date +%s)
timeout 220 python3 tools/bench_train.py $S2 --steps 30 --warmup 5 --variant default: --variant bits:$BITS \
  --variant b16:$B16 --variant best:$BEST --variant best_SHE:$BEST,$SHE \
  --json $OUT/olmoe3_defaults.json 2>&1 | grep -v Warning | tail -8
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
tt olmoe3-4l-8e after 35
echo "torchtitan S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 160 python3 tools/bench_train.py $S1 --steps 12 --warmup 4 --variant bits:$BITS \
  --variant b16:$B16 --variant best:$BEST --variant best_SHE:$BEST,$SHE --variant default: \
  --json $OUT/olmoe8l_defaults.json 2>&1 | grep -v Warning | tail -8
echo "S1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
tt olmoe-1b-7b-8l after 25
echo "torchtitan S1 $(( $(date +%s) - t0 )) s"
