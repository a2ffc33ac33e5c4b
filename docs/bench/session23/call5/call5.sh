#!/usr/bin/env bash
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
t0=$(date +%s)
timeout 90 python3 -m pytest -q -m gpu tests/core/test_precision_emulated.py -k "save_x or fused_mx or copies" 2>&1 | grep -E "^E |passed|failed" | head -20
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
B16=optimizer.state_dtype=bf16,precision.expert_weight_copies=optimizer,precision.expert_grads_bf16=true
MX=optimizer.state_dtype=bf16,precision.recipe=mxfp8,precision.backend=emulated
MXC=$MX,precision.expert_weight_copies=optimizer,precision.expert_grads_bf16=true
X=precision.emulated_save_x_bf16=true
S1="--preset olmoe-1b-7b --model.n_layers=8 --model.vocab_size=100352 --seq-len 4096 --batch 4 --compile --steps 6 --warmup 3"
S2="--preset olmo3-moe-8e --model.n_layers=4 --model.vocab_size=100352 --seq-len 4096 --batch 4 --compile --steps 6 --warmup 3"
timeout 200 python3 tools/bench_train.py $S1 --variant b16:$B16 --variant mxc:$MXC --variant mxcX:$MXC,$X --variant mxX:$MX,$X --json $OUT/olmoe8l.json 2>&1 | grep -v Warning | tail -5
echo "train s1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 200 python3 tools/bench_train.py $S2 --variant b16:$B16 --variant mxc:$MXC --variant mxcX:$MXC,$X --json $OUT/olmoe3.json 2>&1 | grep -v Warning | tail -4
echo "train s2 $(( $(date +%s) - t0 )) s"
