#!/usr/bin/env bash
# Session 60's first call (an H200 wanted; whichever card comes is named in card.txt), session 59's call 1 with
# fp8's code in place of q8's:
# 1. the GPU tests of the 8-bit moments (tests/core/test_moments_q8.py: the kernel in fp8's code, E4M3 under a power
#    of two a block, the first moment to nearest, the second's root floored and rounded stochastically, and in q8's,
#    against the torch reference bit for bit; the optimizer's Triton path against its foreach path);
# 2. tools/bench_optim.py over OLMoE-8L's 3.77B parameters, with bf16 copies: bf16 moments (BLOCK 512..4096), q8 and
#    fp8 at 2, 4, 8 and 16 rows a program (--block 512..4096; the defaults: Q8_ROWS 2, q8's measured best, and
#    FP8_ROWS 4, chosen from static instruction and register counts); the split-master bf16 row (SHE's form) last;
# 3. #13's pairs under nvidia-smi dmon: olmoe3-4l-8e best + SHE with and without optimizer.state_dtype=fp8, then
#    torchtitan 0.3.0; the same on OLMoE-8L.
# Run from the repo root with .peers carried: bash docs/bench/session60/call1.sh (about 520 s fresh).
source docs/bench/session42/common.sh
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv | tee $OUT/card.txt
t0=$(date +%s)
timeout 90 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/core/test_moments_q8.py 2>&1 | tail -3
echo "gpu tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 90 python3 tools/bench_optim.py --variants triton_bf16_copy,triton_q8_copy,triton_fp8_copy,triton_bf16_split \
  --block 512,1024,2048,4096 --steps 5 --json $OUT/bench_optim.json 2>&1 | grep -v Warning | tail -20
echo "bench_optim $(( $(date +%s) - t0 )) s"
F8M=optimizer.state_dtype=fp8
ratio_pairs fp8 "--variant best_SHE:$BEST,$SHE --variant best_SHE_fp8:$BEST,$SHE,$F8M" \
  "--variant best_SHE:$BEST,$SHE --variant best_SHE_fp8:$BEST,$SHE,$F8M"
