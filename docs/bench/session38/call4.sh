#!/usr/bin/env bash
# Session 38, call 4 (the session's last device time, about 530 s): the SwiGLU quantization's third form
# (its own kernel: the tile computed once, the tokens' e4m3 from the scaled values transposed through
# shared memory, 16 warps, no spills) - its bits on the GPU, the kernels against the two they replace at
# 8 and 16 warps; native fp8_blockwise's quantize_input_once (now on by auto) against off; the fused
# SwiGLU's steps. 6 timed steps after 3. Run from the repo root: bash docs/bench/session38/call4.sh (timeout 420)
source docs/bench/session37/common.sh
FS=precision.fp8_fused_swiglu=true
IO0=precision.quantize_input_once=false
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/core/test_blockwise_triton.py --tb=short 2>&1 | grep -v Warning | tail -3
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 45 python3 docs/bench/session38/swiglu_quant_probe.py --json $OUT/swiglu_quant.json 2>&1 | grep -v Warning | tail -12
echo "probe $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 125 python3 tools/bench_train.py $S1 --steps 6 --warmup 3 --variant f8gc:$F8,$G,$C --variant f8gc_io0:$F8,$G,$C,$IO0 \
  --variant f8gcs:$F8,$G,$C,$FS --json $OUT/steps_S1.json 2>&1 | grep -v Warning | tail -4
echo "S1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 140 python3 tools/bench_train.py $S2 --steps 6 --warmup 3 --variant f8gc:$F8,$G,$C --variant f8gc_io0:$F8,$G,$C,$IO0 \
  --variant f8gcs:$F8,$G,$C,$FS --json $OUT/steps_S2.json 2>&1 | grep -v Warning | tail -4
echo "S2 $(( $(date +%s) - t0 )) s"
