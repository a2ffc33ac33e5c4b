#!/usr/bin/env bash
# Session 37 call 2: the 128x128 weight quantization writing only the pass's own operand under
# torch.compile (w in the forward, w^T in the backward), its GPU test, the host probe (which host
# piece of an FP8 grouped GEMM outlasts its GPU time), and OLMoE-8L's f8g profile again beside call 1's.
# Run from the repo root: bash docs/bench/session37/call2.sh (timeout 600; at most about 330 s).
source docs/bench/session37/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
git log -1 --format=%h 2>/dev/null
t0=$(date +%s)
timeout 60 python3 -m pytest -q -m gpu tests/core/test_blockwise_triton.py --tb=short 2>&1 | grep -v Warning | tail -4
timeout 90 python3 -m pytest -q -m gpu tests/core/test_precision_fp8.py -k "fullgraph" --tb=short 2>&1 | grep -v Warning | tail -4
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 90 python3 docs/bench/session37/host_probe.py --json $OUT/host_probe.json 2>&1 | grep -v Warning | tail -20
echo "probe $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 100 python3 tools/profile_step.py $S1 $(echo "$F8,$G" | tr ',' '\n' | sed 's/^/--/' | tr '\n' ' ') \
  --wait 2 --warmup 1 --active 2 --top 12 --json $OUT/profile_S1_f8g.json 2>&1 | grep -v Warning | tail -40
echo "profile $(( $(date +%s) - t0 )) s"
