#!/usr/bin/env bash
# Session 36 call 4 (session 35's call 7, never run): #13's olmoe3-4l-8e ratio against torchtitan measured with its
# noise. Session 34 got 1.196x with the best row (1.2x missed by 0.35%, about the two b16 rows' spread):
# here torchtitan before and after, moetron's best row twice between b16 rows, 30 timed steps each, so
# the ratio comes with a spread. Needs .peers carried.
# Run from the repo root: bash docs/bench/session36/call4.sh (timeout 600; about 500 s warm).
source docs/bench/session32/switches.sh
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
python3 -m pip install -q --no-index --no-deps --target /tmp/site_tt .peers/whl/*.whl >/dev/null 2>&1
tt() {
  PYTHONPATH=/tmp/site_tt timeout 110 python3 .peers/torchtitan_moe_bench.py --config olmoe3-4l-8e --compile --steps 35 \
    --warmup 5 > $OUT/torchtitan_$1.jsonl 2>$OUT/torchtitan_$1.err
  grep '"result"' $OUT/torchtitan_$1.jsonl | cut -c1-420
}
t0=$(date +%s)
tt before
echo "torchtitan $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 300 python3 tools/bench_train.py $S2 --steps 30 --warmup 5 --variant b16:$B16 --variant best:$BEST \
  --variant b16_2:$B16 --variant best_2:$BEST --json $OUT/olmoe3_best_x2.json 2>&1 | grep -v Warning | tail -5
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
tt after
echo "torchtitan $(( $(date +%s) - t0 )) s"
