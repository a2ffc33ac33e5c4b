#!/usr/bin/env bash
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
MXC=--precision.recipe=mxfp8,--precision.backend=emulated,--precision.expert_weight_copies=optimizer,--precision.expert_grads_bf16=true
[ -z "${SKIP_CONV:-}" ] && SHM_RUNS="mxc_s0 mxc_s1 mxc_s2" timeout 330 bash .scratch/conv.sh mxc_s0:$MXC,--trainer.seed=0 mxc_s1:$MXC,--trainer.seed=1 mxc_s2:$MXC,--trainer.seed=2 2>&1 | tail -12
python3 -m pip install -q --no-index --no-deps --target /tmp/site_tt .peers/whl/*.whl
B16=optimizer.state_dtype=bf16,precision.expert_weight_copies=optimizer,precision.expert_grads_bf16=true
SHAPE=${SHAPE:-olmoe3}
if [ $SHAPE = olmoe3 ]; then TT=olmoe3-4l-8e; MS="--preset olmo3-moe-8e --model.n_layers=4 --model.vocab_size=100352"; else TT=olmoe-1b-7b-8l; MS="--preset olmoe-1b-7b --model.n_layers=8 --model.vocab_size=100352"; fi
PYTHONPATH=/tmp/site_tt timeout 170 python3 .peers/torchtitan_moe_bench.py --config $TT --compile --steps 20 --warmup 5 > $OUT/tt_$SHAPE.jsonl 2>$OUT/tt_$SHAPE.err; echo tt rc=$?; tail -1 $OUT/tt_$SHAPE.jsonl
timeout 150 python3 tools/bench_train.py $MS --seq-len 4096 --batch 4 --compile --steps 15 --warmup 5 --variant b16:$B16 --json $OUT/moetron_$SHAPE.json 2>&1 | grep -v Warning | tail -3
