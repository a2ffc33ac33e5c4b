#!/usr/bin/env bash
# #13's ratio against torchtitan on olmoe3-4l-8e in one call (../shared/peers/README.md; last taken in
# session 22: 1.13x): torchtitan 0.3.0 first, then moetron's b16 row, same shape and tokens per step.
# Needs .peers/ (the bench script and its wheels) carried. Run from the repo root through the device
# tool: bash docs/bench/session29/call4.sh (timeout 300).
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --target /tmp/site_tt .peers/whl/*.whl >/dev/null 2>&1
t0=$(date +%s)
PYTHONPATH=/tmp/site_tt timeout 140 python3 .peers/torchtitan_moe_bench.py --config olmoe3-4l-8e --compile --steps 20 \
  --warmup 5 > $OUT/torchtitan_olmoe3.jsonl 2>$OUT/torchtitan_olmoe3.err
grep '"result"' $OUT/torchtitan_olmoe3.jsonl | cut -c1-400; tail -2 $OUT/torchtitan_olmoe3.err | cut -c1-300
echo "torchtitan $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 130 python3 tools/bench_train.py $S2 --steps 15 --warmup 5 --variant b16:$B16 --json $OUT/olmoe3_b16.json 2>&1 \
  | grep -v Warning | tail -3
echo "moetron $(( $(date +%s) - t0 )) s"
