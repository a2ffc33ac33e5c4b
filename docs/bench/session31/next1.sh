#!/usr/bin/env bash
# precision.dense_weight_copies (built in session 31, not yet run on a GPU): its GPU test, then its
# on/off rows on both #13 shapes, one process per shape (b16 against b16 + the dense copies).
# Run from the repo root: bash docs/bench/session31/next1.sh (timeout 590; about 400 s warm-started).
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 150 python3 -m pytest -q -m gpu tests/core/test_dense_copies.py 2>&1 | tail -3
echo "tests $(( $(date +%s) - t0 )) s"
D=precision.dense_weight_copies=true
for shape in S2 S1; do
  t0=$(date +%s)
  timeout 190 python3 tools/bench_train.py ${!shape} --steps 12 --warmup 3 --variant b16:$B16 --variant b16D:$B16,$D \
    --variant b16_again:$B16 --json $OUT/dense_copies_$shape.json 2>&1 | grep -v Warning | tail -4
  echo "$shape $(( $(date +%s) - t0 )) s"
done
