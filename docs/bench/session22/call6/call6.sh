#!/usr/bin/env bash
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 120 python3 -m pytest -q -m gpu tests/core/test_precision_emulated.py -k "tiles or fused or copies" 2>&1 | tail -2
timeout 120 python3 tools/bench_quantize.py --mx --json $OUT/quantize_mx.json 2>&1 | grep -v Warning
BEST=$(python3 - <<'PY'
import json, os, collections
rows = json.load(open(os.environ["OUT"] + "/quantize_mx.json"))["rows"]
tot = collections.defaultdict(float)
for r in rows:
    if r["tile"] != "copy":
        tot[r["tile"]] += r["ms"]
best = min(tot, key=tot.get)
cols, w = best.split(" cols w")
print(f"{cols},{w}")
PY
)
echo "best tile: $BEST"
MX=optimizer.state_dtype=bf16,precision.recipe=mxfp8,precision.backend=emulated
MXC=$MX,precision.expert_weight_copies=optimizer,precision.expert_grads_bf16=true
S1="--preset olmoe-1b-7b --model.n_layers=8 --model.vocab_size=100352 --seq-len 4096 --batch 4 --compile --steps 6 --warmup 3"
[ "$BEST" != "128,4" ] && MOETRON_MX_BOTH_TILE=$BEST timeout 150 python3 tools/bench_train.py $S1 --variant mxc_tile:$MXC --json $OUT/olmoe8l_mxc_tile.json 2>&1 | grep -v Warning | tail -2
timeout 150 python3 tools/bench_train.py $S1 --variant mxc:$MXC --json $OUT/olmoe8l_mxc.json 2>&1 | grep -v Warning | tail -2
