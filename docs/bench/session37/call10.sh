#!/usr/bin/env bash
# Queued for session 38 (not run: session 37's device time was spent): the GPU tests of session 37's last
# code (5d452e6, 3224d53: not yet run on a GPU), the host's time per FP8 GEMM by
# dispatch (custom_op against a Library.define / impl op against the body called directly) with the Gluon
# layouts cached (session 37, after call 9); the 1x128 quantization's one config (4 warps, no autotuner)
# beside 8 warps and autotuned; the moe-1t slice's fp8 peak (planned 31.1 GiB since the wgrad stores bf16;
# call 9's 80 s ran out before its result); both shapes' b16 / f8gc steps on this code.
# Run from the repo root: bash docs/bench/session37/call10.sh (timeout 600; at most about 600 s: drop S2 if the tests run long).
source docs/bench/session37/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
# the session's code on the GPU first: the Gluon file (layouts cached, bf16 wgrad out), the default's
# resolution (fp8_experts=auto -> gluon on SM90) and the 4-warp quantization's bits
timeout 90 python3 -m pytest -q -m gpu tests/core/test_fp8_gluon.py tests/core/test_blockwise_triton.py --tb=short 2>&1 \
  | grep -v Warning | tail -4
python3 -c "from moetron.core.precision import PrecisionConfig as P; print('fp8_experts auto ->', P(recipe='fp8_blockwise').build('cuda', verbose=False).gemm.experts)"
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 50 python3 docs/bench/session37/host_probe.py --n 20 --json $OUT/host_probe.json 2>&1 | grep -v Warning | tail -18
echo "probe $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 60 python3 tools/bench_quantize.py --json $OUT/quantize.json 2>&1 | grep -v Warning | tail -5
echo "quantize $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 160 python3 tools/bench_slice.py --preset moe-1t --ep 8 --pp 8 --layers 2 --seq-len 8192 --steps 4 --warmup 2 \
  --compile --variant fp8:precision.recipe=fp8_blockwise,memory.recompute=none --json $OUT/slice_fp8.json 2>&1 \
  | grep -v Warning | tail -3
echo "slice $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 130 python3 tools/bench_train.py $S1 --steps 8 --warmup 3 --variant b16:$B16 --variant f8gc:$F8,$G,$C \
  --json $OUT/steps_S1.json 2>&1 | grep -v Warning | tail -3
echo "S1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 130 python3 tools/bench_train.py $S2 --steps 8 --warmup 3 --variant b16:$B16 --variant f8gc:$F8,$G,$C \
  --json $OUT/steps_S2.json 2>&1 | grep -v Warning | tail -3
echo "S2 $(( $(date +%s) - t0 )) s"
