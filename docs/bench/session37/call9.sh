#!/usr/bin/env bash
# Session 37 call 9 (the device budget's last ~380 s, a cold start included): the host probe's cProfile
# (where the FP8 grouped GEMM's ~0.3 ms of host time goes); the moe-1t slice's fp8 peak since the wgrad
# kernels store bf16 (the planner now predicts 31.1 GiB; 36.8 measured with the fp32 output + cast);
# olmoe3-4l-8e's f8gc step without and with CUDA graphs on the compiled blocks (TORCHINDUCTOR_CUDAGRAPHS=1,
# Inductor's cudagraph trees: an experiment, no moetron switch).
# Run from the repo root: bash docs/bench/session37/call9.sh (timeout 300).
source docs/bench/session37/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 40 python3 docs/bench/session37/host_probe.py --n 10 --cprofile 30 --json $OUT/host_probe.json > $OUT/probe.log 2>&1
grep -A20 "=== cProfile" $OUT/probe.log | grep -v "^$" | cut -c1-160 | head -46
echo "probe $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 80 python3 tools/bench_slice.py --preset moe-1t --ep 8 --pp 8 --layers 2 --seq-len 8192 --steps 4 --warmup 2 \
  --compile --variant fp8:precision.recipe=fp8_blockwise,memory.recompute=none --json $OUT/slice_fp8.json 2>&1 \
  | grep -v Warning | tail -3
echo "slice $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 60 python3 tools/bench_train.py $S2 --steps 6 --warmup 3 --variant f8gc:$F8,$G,$C --json $OUT/steps_S2.json 2>&1 \
  | grep -v Warning | tail -1
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
TORCHINDUCTOR_CUDAGRAPHS=1 timeout 75 python3 tools/bench_train.py $S2 --steps 6 --warmup 3 --variant f8gc:$F8,$G,$C \
  --json $OUT/steps_S2_cudagraphs.json > $OUT/cudagraphs.log 2>&1
grep -v Warning $OUT/cudagraphs.log | grep -iE "f8gc|error|skipping cudagraph|Traceback" | head -8 | cut -c1-240
echo "S2 cudagraphs $(( $(date +%s) - t0 )) s"
