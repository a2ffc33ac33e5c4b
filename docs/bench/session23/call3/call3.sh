#!/usr/bin/env bash
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
t0=$(date +%s)
timeout 150 python3 -m pytest -q -m gpu tests/core/test_precision_emulated.py tests/core/test_mx.py 2>&1 | tail -2
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
B16=optimizer.state_dtype=bf16,precision.expert_weight_copies=optimizer,precision.expert_grads_bf16=true
MX=optimizer.state_dtype=bf16,precision.recipe=mxfp8,precision.backend=emulated
MXC=$MX,precision.expert_weight_copies=optimizer,precision.expert_grads_bf16=true
S1="--preset olmoe-1b-7b --model.n_layers=8 --model.vocab_size=100352 --seq-len 4096 --batch 4 --compile --steps 6 --warmup 3"
timeout 200 python3 tools/bench_train.py $S1 --variant b16:$B16 --variant mx:$MX --variant mxc:$MXC --json $OUT/olmoe8l.json 2>&1 | grep -v Warning | tail -4
echo "train $(( $(date +%s) - t0 )) s"
