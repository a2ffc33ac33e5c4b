#!/usr/bin/env bash
# Session 32's queued call 4 (not yet run): #13's olmoe3-4l-8e ratio against torchtitan: torchtitan 0.3.0,
# then moetron b16 and b16 with the switches that calls 1-3 show help (BEST; default: all of session
# 31-32's). Needs .peers carried (../shared/peers/README.md).
# Run from the repo root: [BEST=<overrides>] bash docs/bench/session32/call4.sh (timeout 590; about 330 s warm-started).
source docs/bench/session32/switches.sh
BEST=${BEST:-$ALL}
python3 -m pip install -q --no-index --no-deps --target /tmp/site_tt .peers/whl/*.whl >/dev/null 2>&1
t0=$(date +%s)
PYTHONPATH=/tmp/site_tt timeout 150 python3 .peers/torchtitan_moe_bench.py --config olmoe3-4l-8e --compile --steps 20 \
  --warmup 5 > $OUT/torchtitan_olmoe3.jsonl 2>$OUT/torchtitan_olmoe3.err
grep '"result"' $OUT/torchtitan_olmoe3.jsonl | cut -c1-420; tail -2 $OUT/torchtitan_olmoe3.err | cut -c1-300
echo "torchtitan $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 200 python3 tools/bench_train.py $S2 --steps 15 --warmup 5 --variant b16:$B16 --variant best:$B16,$BEST \
  --json $OUT/olmoe3_vs_tt.json 2>&1 | grep -v Warning | tail -4
echo "moetron $(( $(date +%s) - t0 )) s"
