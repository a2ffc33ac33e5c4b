#!/usr/bin/env bash
# Session 48, the short form of call1.sh (under about 450 s of device time on a fresh machine): the GPU tests
# of split_master and the embedding's copy, olmoe3-4l-8e's best row against best + split_master +
# head_grads_bf16 + embedding_weight_copy (30 timed steps after 5, alternating), then torchtitan after them.
# Needs .peers carried. Run from the repo root: bash docs/bench/session48/call1_short.sh (about 280 s warm).
source docs/bench/session42/common.sh
NEW=optimizer.split_master=true,precision.head_grads_bf16=true,precision.embedding_weight_copy=true
t0=$(date +%s)
timeout 100 python3 -m pytest -q -m gpu tests/core/test_split_master.py tests/core/test_embedding.py 2>&1 | tail -3
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 160 python3 tools/bench_train.py $S2 --steps 30 --warmup 5 --variant best:$BEST --variant best_SHE:$BEST,$NEW \
  --variant best_2:$BEST --variant best_SHE_2:$BEST,$NEW --json $OUT/olmoe3_new.json 2>&1 | grep -v Warning | tail -6
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
tt olmoe3-4l-8e after 35
echo "torchtitan $(( $(date +%s) - t0 )) s"
