#!/usr/bin/env bash
# Ready for the next session that is lent the H200 (session 24 had no device), call 1 of 2: the GPU
# tests of precision.quantize_input_once and 7c0ba08's plumbing, then the switch on and off on both
# shapes. Run from the repo root through the device tool: bash docs/bench/session24/next_call.sh (timeout 600).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
t0=$(date +%s)
timeout 120 python3 -m pytest -q -m gpu tests/core/test_precision_input_once.py tests/core/test_precision_emulated.py \
  tests/core/test_fp8_rowwise.py 2>&1 | grep -E "^E |passed|failed" | head -20
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
B16=optimizer.state_dtype=bf16,precision.expert_weight_copies=optimizer,precision.expert_grads_bf16=true
MX=optimizer.state_dtype=bf16,precision.recipe=mxfp8,precision.backend=emulated
MXC=$MX,precision.expert_weight_copies=optimizer,precision.expert_grads_bf16=true
X=precision.emulated_save_x_bf16=true
I=precision.quantize_input_once=true
F8RFC=optimizer.state_dtype=bf16,precision.recipe=fp8_rowwise,precision.fp8_fast_accum=true,precision.expert_weight_copies=optimizer,precision.expert_grads_bf16=true
S1="--preset olmoe-1b-7b --model.n_layers=8 --model.vocab_size=100352 --seq-len 4096 --batch 4 --compile --steps 6 --warmup 3"
S2="--preset olmo3-moe-8e --model.n_layers=4 --model.vocab_size=100352 --seq-len 4096 --batch 4 --compile --steps 6 --warmup 3"
timeout 200 python3 tools/bench_train.py $S1 --variant b16:$B16 --variant mxcX:$MXC,$X --variant mxcXI:$MXC,$X,$I \
  --json $OUT/olmoe8l.json 2>&1 | grep -v Warning | tail -5
echo "train s1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 250 python3 tools/bench_train.py $S2 --variant b16:$B16 --variant mxcX:$MXC,$X --variant mxcXI:$MXC,$X,$I \
  --variant f8rfc:$F8RFC --variant f8rfcI:$F8RFC,$I --json $OUT/olmoe3.json 2>&1 | grep -v Warning | tail -4
echo "train s2 $(( $(date +%s) - t0 )) s"
