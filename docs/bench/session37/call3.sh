#!/usr/bin/env bash
# Session 37 call 3: the native fp8_blockwise recipe on the optimizer's bf16 expert copies
# (precision.expert_weight_copies=optimizer, expert_grads_bf16=true: the 128x128 quantization reads
# 2 B an element, the Gluon / Triton wgrad stores bf16): GPU tests, then both shapes' steps b16 / f8g /
# f8gc (b16 has had the copies since session 22), and OLMoE-8L's f8gc profile.
# Run from the repo root: bash docs/bench/session37/call3.sh (timeout 600; at most about 520 s).
source docs/bench/session37/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 100 python3 -m pytest -q -m gpu tests/core/test_precision_fp8.py -k "bf16_weight_copies or bf16_copies" \
  --tb=short 2>&1 | grep -v Warning | tail -6
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 170 python3 tools/bench_train.py $S1 --steps 8 --warmup 3 --variant b16:$B16 --variant f8g:$F8,$G \
  --variant f8gc:$F8,$G,$C --json $OUT/steps_S1.json 2>&1 | grep -v Warning | tail -5
echo "S1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 170 python3 tools/bench_train.py $S2 --steps 8 --warmup 3 --variant b16:$B16 --variant f8g:$F8,$G \
  --variant f8gc:$F8,$G,$C --json $OUT/steps_S2.json 2>&1 | grep -v Warning | tail -5
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 70 python3 tools/profile_step.py $S1 $(echo "$F8,$G,$C" | tr ',' '\n' | sed 's/^/--/' | tr '\n' ' ') \
  --wait 2 --warmup 1 --active 2 --top 8 --json $OUT/profile_S1_f8gc.json 2>&1 | grep -v Warning | tail -14
echo "profile $(( $(date +%s) - t0 )) s"
