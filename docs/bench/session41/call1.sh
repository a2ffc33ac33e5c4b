#!/usr/bin/env bash
# Queued for session 41: #13's 1.2x on olmoe3-4l-8e, a second same-run sample (session 39 call 3:
# 1.185-1.201x over four pairings). torchtitan before and after, moetron's best row four times between,
# 30 timed steps each (session 39 call 3's form without the CUDA graph, which is within noise there).
# Needs .peers carried. Run from the repo root: bash docs/bench/session41/call1.sh (timeout 600; about
# 500 s warm, so give it a machine of its own).
source docs/bench/session32/switches.sh
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
python3 -m pip install -q --no-index --no-deps --target /tmp/site_tt .peers/whl/*.whl >/dev/null 2>&1
tt() {
  PYTHONPATH=/tmp/site_tt timeout 130 python3 .peers/torchtitan_moe_bench.py --config olmoe3-4l-8e --compile --steps 35 \
    --warmup 5 > $OUT/torchtitan_$1.jsonl 2>$OUT/torchtitan_$1.err
  grep '"result"' $OUT/torchtitan_$1.jsonl | cut -c1-420
}
t0=$(date +%s)
tt before
echo "torchtitan $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 300 python3 tools/bench_train.py $S2 --steps 30 --warmup 5 --variant best:$BEST --variant best_2:$BEST \
  --variant best_3:$BEST --variant best_4:$BEST --json $OUT/olmoe3_best_x4.json 2>&1 | grep -v Warning | tail -5
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
tt after
echo "torchtitan $(( $(date +%s) - t0 )) s"
