#!/usr/bin/env bash
# Session 57's second call (meant for an H200; whichever card comes is named in card.txt):
# 1. the loss row kernel's new PROGRAMS (fewer programs than rows, each looping over rows, so fewer 200 KB rows in
#    flight and the second read can come from L2), its GPU test first, swept with NUM_STAGES 1 and 3;
# 2. the SM clock and power under load during olmoe3's best + SHE and torchtitan (next.sh without its tests; call
#    1's H100 ran both power-capped at 700 W, about 1,500 MHz);
# 3. the inductor kernels' bandwidth on OLMoE-8L (inductor_bw.sh, its benchmark harness off for torch 2.11).
# Run from the repo root with .peers carried: bash docs/bench/session57/call2.sh (about 380 s fresh).
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,power.limit,power.max_limit,clocks.max.sm,clocks.max.mem --format=csv | tee $OUT/card.txt
pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -1
MOETRON_PYTHON=$(command -v python3) timeout 120 python3 -m pytest -q -m gpu tests/core/test_loss_triton.py 2>&1 | tail -1
timeout 150 python3 tools/bench_loss.py --rows --chunk-tokens 4096,16384 --row-blocks 4096 --row-warps 8 \
  --row-stages 1,3 --row-programs 0,132,264,528 --json $OUT/loss_programs.json 2>&1 | grep -v Warning
SKIP_TESTS=1 bash docs/bench/session56/next.sh
echo "==== inductor bandwidth, OLMoE-8L"
SHAPES=S1 bash docs/bench/session56/inductor_bw.sh
