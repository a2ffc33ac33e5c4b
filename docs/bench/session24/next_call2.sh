#!/usr/bin/env bash
# Ready for the next session that is lent the H200, call 2 of 2: optimizer.overlap's GPU test (the
# side stream bit-identical to the sequential step, eager and compiled), then the switch on and off
# on both shapes of the throughput issue (bf16 with its best switches, compiled).
# Run from the repo root through the device tool: bash docs/bench/session24/next_call2.sh (timeout 600).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
t0=$(date +%s)
timeout 120 python3 -m pytest -q -m gpu tests/core/test_overlap.py 2>&1 | grep -E "^E |passed|failed" | head -20
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
B16=optimizer.state_dtype=bf16,precision.expert_weight_copies=optimizer,precision.expert_grads_bf16=true
O=optimizer.overlap=true
S1="--preset olmoe-1b-7b --model.n_layers=8 --model.vocab_size=100352 --seq-len 4096 --batch 4 --compile --steps 8 --warmup 3"
S2="--preset olmo3-moe-8e --model.n_layers=4 --model.vocab_size=100352 --seq-len 4096 --batch 4 --compile --steps 8 --warmup 3"
timeout 200 python3 tools/bench_train.py $S2 --variant b16:$B16 --variant b16O:$B16,$O --variant b16b:$B16 \
  --variant b16Ob:$B16,$O --json $OUT/olmoe3.json 2>&1 | grep -v Warning | tail -6
echo "train s2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 200 python3 tools/bench_train.py $S1 --variant b16:$B16 --variant b16O:$B16,$O --json $OUT/olmoe8l.json \
  2>&1 | grep -v Warning | tail -4
echo "train s1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
# kernel sum over wall time ("busy") above 1: the streams overlap
timeout 120 python3 tools/profile_step.py --preset olmo3-moe-8e --model.n_layers=4 --model.vocab_size=100352 \
  --seq-len 4096 --batch 4 --compile --optimizer.state_dtype=bf16 --precision.expert_weight_copies=optimizer \
  --precision.expert_grads_bf16=true --optimizer.overlap=true --json $OUT/profile_olmoe3.json 2>&1 | tail -25
echo "profile $(( $(date +%s) - t0 )) s"
