#!/usr/bin/env bash
# Queued by session 56: the fused loss' row kernel (core/layers/cross_entropy_triton.py) reads each [V] row twice
# and writes it once; the second read comes from L2 only while the rows in flight fit it. The kernel takes 2.7 ms
# of OLMoE-8L's best + SHE step on the H200 (one 16,384-token chunk) where a read and a write at 4.3 TB/s would take
# 1.5. NUM_STAGES (new, default 1: the same SASS as before) pipelines both passes' loads through shared memory, so
# fewer programs (fewer rows in flight) can keep HBM busy. This sweeps it beside the block and warps, at the best
# row's chunk (16,384 tokens) and the default's (4,096). If a setting wins by more than noise, set it and measure
# both #13 shapes' steps with and without (bench_train, same run), then the profile.
# Run from the repo root: bash docs/bench/session56/loss_stages.sh (timeout 600; about 90 s on a fresh machine).
source docs/bench/session42/common.sh
# First the kernel's GPU test on the changed loops (tl.range; its SASS at stages 1 matched the old one under Triton
# 3.9 on the CPU; this machine has 3.6).
MOETRON_PYTHON=$(command -v python3) timeout 120 python3 -m pytest -q -m gpu tests/core/test_loss_triton.py 2>&1 | tail -1
timeout 300 python3 tools/bench_loss.py --rows --chunk-tokens 4096,16384 --row-blocks 4096,8192 --row-warps 4,8 \
  --row-stages 1,2,3 --json $OUT/loss_rows.json 2>&1 | grep -v Warning
