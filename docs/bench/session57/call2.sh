#!/usr/bin/env bash
# Session 57's second call, meant for an H200: the SM clock and power under load during olmoe3's best + SHE and
# torchtitan (next.sh without its tests; call 1's card was an H100, both power-capped at 700 W there), then the
# inductor kernels' bandwidth on OLMoE-8L (inductor_bw.sh, its benchmark harness now off for torch 2.11).
# Run from the repo root with .peers carried: bash docs/bench/session57/call2.sh (about 330 s fresh).
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,power.limit,power.max_limit,clocks.max.sm,clocks.max.mem --format=csv | tee $OUT/card.txt
pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -1
SKIP_TESTS=1 bash docs/bench/session56/next.sh
echo "==== inductor bandwidth, OLMoE-8L"
SHAPES=S1 bash docs/bench/session56/inductor_bw.sh
