#!/usr/bin/env bash
# Call 3 of the next session lent the H200 (after session25/next_call.sh and session24/next_call2.sh,
# the overlap): the same switches on olmoe3-4l-8e (the issues ask for every switch's row on both
# shapes), fp8_rowwise's input_once included.
# Run from the repo root through the device tool: bash docs/bench/session25/next_call2.sh (timeout 600).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
t0=$(date +%s)
# the GPU tests of code session 25 refactored (the fused MX kernel through lean_rows_qdq) and fp8_rowwise's
timeout 150 python3 -m pytest -q -m gpu tests/core/test_fp8_rowwise.py tests/core/test_precision_emulated.py \
  tests/core/test_mx.py 2>&1 | grep -E "^E |passed|failed" | head -20
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
B16=optimizer.state_dtype=bf16,precision.expert_weight_copies=optimizer,precision.expert_grads_bf16=true
MXC=$B16,precision.recipe=mxfp8,precision.backend=emulated
X=precision.emulated_save_x_bf16=true
I=precision.quantize_input_once=true
Q=precision.quantized_expert_copies=true
F8RFC=$B16,precision.recipe=fp8_rowwise,precision.fp8_fast_accum=true
S2="--preset olmo3-moe-8e --model.n_layers=4 --model.vocab_size=100352 --seq-len 4096 --batch 4 --compile --steps 6 --warmup 3"
timeout 420 python3 tools/bench_train.py $S2 --variant b16:$B16 --variant mxcX:$MXC,$X --variant mxcXQ:$MXC,$X,$Q \
  --variant mxcXI:$MXC,$X,$I --variant f8rfc:$F8RFC --variant f8rfcI:$F8RFC,$I --json $OUT/olmoe3.json 2>&1 \
  | grep -v Warning | tail -8
echo "train s2 $(( $(date +%s) - t0 )) s"
