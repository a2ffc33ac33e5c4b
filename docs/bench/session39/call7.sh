#!/usr/bin/env bash
# Queued for session 40: precision.fp8_quantize_warps (session 39) in a step. Call 1 of session 39 had the
# 1x128 kernel 9-17% faster on 8 warps in isolation, session 38's H100 0.7% apart, the H200 favouring 4.
# Its GPU check first (the 1x128 kernel's bits at 4 and 8 warps; trainer.cuda_graph's micro-batch test), bench_quantize on this machine, then both
# shapes' f8gc with 4 warps (the default) and 8, twice each.
# Run from the repo root: bash docs/bench/session39/call7.sh (timeout 600; about 450 s warm)
source docs/bench/session37/common.sh
W8=precision.fp8_quantize_warps=8
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/core/test_blockwise_triton.py -k on_gpu --tb=short 2>&1 \
  | grep -v Warning | tail -3
# trainer.cuda_graph's micro-batch case (added after session 39's calls)
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/core/test_cuda_graph.py -k micro_batches --tb=short 2>&1 \
  | grep -v "Warning\|DEBUG" | tail -3
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 40 python3 tools/bench_quantize.py --json $OUT/quantize.json 2>&1 | grep -v Warning | tail -5
echo "quantize $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 170 python3 tools/bench_train.py $S1 --steps 10 --warmup 3 --variant f8gc:$F8,$G,$C --variant f8gc_w8:$F8,$G,$C,$W8 \
  --variant f8gc_2:$F8,$G,$C --variant f8gc_w8_2:$F8,$G,$C,$W8 --json $OUT/steps_S1.json 2>&1 | grep -v Warning | tail -5
echo "S1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 190 python3 tools/bench_train.py $S2 --steps 10 --warmup 3 --variant f8gc:$F8,$G,$C --variant f8gc_w8:$F8,$G,$C,$W8 \
  --variant f8gc_2:$F8,$G,$C --variant f8gc_w8_2:$F8,$G,$C,$W8 --json $OUT/steps_S2.json 2>&1 | grep -v Warning | tail -5
echo "S2 $(( $(date +%s) - t0 )) s"
