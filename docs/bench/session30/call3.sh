#!/usr/bin/env bash
# olmoe3-4l-8e: b16 beside mxfp8 emulated in each MX tile order (MOETRON_MX_GRID per process; the
# default is now cols-first); then #13's OLMoE-8L ratio against torchtitan on this GPU (needs .peers
# carried, as session 29's call4.sh). Run from the repo root: bash docs/bench/session30/call3.sh (timeout 560).
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
for order in rows-first cols-first; do
  t0=$(date +%s)
  MOETRON_MX_GRID=$order timeout 130 python3 tools/bench_train.py $S2 --steps 10 --warmup 3 --variant b16_${order%%-*}:$B16 \
    --variant mxcXI_${order%%-*}:$MXC,$X,$I --json $OUT/olmoe3_$order.json 2>&1 | grep -v Warning | tail -3
  echo "$order $(( $(date +%s) - t0 )) s"
done
python3 -m pip install -q --no-index --no-deps --target /tmp/site_tt .peers/whl/*.whl >/dev/null 2>&1
t0=$(date +%s)
PYTHONPATH=/tmp/site_tt timeout 120 python3 .peers/torchtitan_moe_bench.py --config olmoe-1b-7b-8l --compile --steps 20 \
  --warmup 5 > $OUT/torchtitan_olmoe8l.jsonl 2>$OUT/torchtitan_olmoe8l.err
grep '"result"' $OUT/torchtitan_olmoe8l.jsonl | cut -c1-420; tail -2 $OUT/torchtitan_olmoe8l.err | cut -c1-300
echo "torchtitan $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 110 python3 tools/bench_train.py $S1 --steps 15 --warmup 5 --variant b16:$B16 --json $OUT/olmoe8l_b16.json 2>&1 \
  | grep -v Warning | tail -3
echo "moetron $(( $(date +%s) - t0 )) s"
