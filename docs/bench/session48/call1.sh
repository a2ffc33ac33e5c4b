#!/usr/bin/env bash
# Session 48, call 1 (session 47's call1.sh with precision.embedding_weight_copy): the GPU tests of
# optimizer.split_master and of the embedding's copy, then olmoe3-4l-8e's compiled best row against
# best + split_master (S), + head_grads_bf16 (H), + embedding_weight_copy (E), repeated, then torchtitan 0.3.0
# on olmoe3-4l-8e after them (#13's 1.2x in the same run). Needs .peers carried.
# Run from the repo root: bash docs/bench/session48/call1.sh (timeout 600; about 380 s warm).
source docs/bench/session42/common.sh
SP=optimizer.split_master=true
HG=precision.head_grads_bf16=true
EC=precision.embedding_weight_copy=true
t0=$(date +%s)
timeout 150 python3 -m pytest -q -m gpu tests/core/test_split_master.py tests/core/test_embedding.py 2>&1 | tail -3
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 230 python3 tools/bench_train.py $S2 --steps 30 --warmup 5 --variant best:$BEST --variant best_S:$BEST,$SP \
  --variant best_SH:$BEST,$SP,$HG --variant best_SHE:$BEST,$SP,$HG,$EC --variant best_2:$BEST \
  --variant best_SHE_2:$BEST,$SP,$HG,$EC --json $OUT/olmoe3_split_x2.json 2>&1 | grep -v Warning | tail -8
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
tt olmoe3-4l-8e after 35
echo "torchtitan $(( $(date +%s) - t0 )) s"
