#!/usr/bin/env bash
# Session 59's first call: optimizer.state_dtype=q8 (8-bit Adam moments, new) on the GPU, beside session 58's
# queued measurements, in one call (about 480 s fresh):
# 1. the GPU tests of the q8 kernel, the AdamW kernel and the reverted loss row kernel;
# 2. tools/bench_optim.py: bf16 and q8 moments alone over OLMoE-8L's 3.77B parameters, q8's tile swept
#    (--block 512,1024,2048 = Q8_ROWS 2, 4, 8);
# 3. nvidia-smi dmon over every step run below (tools/clocks.py dmon: each run's clock and power under load);
# 4. olmoe3-4l-8e: best + SHE, then + q8 (30 steps), then torchtitan 0.3.0; OLMoE-8L the same (12 steps).
# (Its pairs through docs/bench/session42/common.sh's ratio_pairs since the review; the same runs.)
# Run from the repo root with .peers carried: bash docs/bench/session59/call1.sh (SKIP_S1=1: olmoe3 only).
source docs/bench/session42/common.sh
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv | tee $OUT/card.txt
t0=$(date +%s)
timeout 150 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/core/test_moments_q8.py \
  tests/core/test_adamw_triton.py tests/core/test_loss_triton.py 2>&1 | tail -4
echo "gpu tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 90 python3 tools/bench_optim.py --variants triton_bf16,triton_bf16_copy,triton_q8,triton_q8_copy \
  --block 512,1024,2048 --json $OUT/bench_optim.json 2>&1 | grep -v Warning | tail -16
echo "bench_optim $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
Q8=optimizer.state_dtype=q8
ratio_pairs q8 "--variant best_SHE:$BEST,$SHE --variant best_SHE_q8:$BEST,$SHE,$Q8" \
  "--variant best_SHE:$BEST,$SHE --variant best_SHE_q8:$BEST,$SHE,$Q8"
