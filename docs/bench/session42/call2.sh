#!/usr/bin/env bash
# Session 42, on an H200 (the GPU #13's and #14's targets were set on; the last same-run torchtitan
# comparison on one was session 22's, before sessions 23-41's levers): olmoe3-4l-8e against torchtitan,
# moetron's best row twice and native fp8_blockwise's f8gc once between torchtitan's before and after
# (30 timed steps after 5, session 39 call 3's form). Needs .peers carried.
# Run from the repo root: bash docs/bench/session42/call2.sh (timeout 600; about 250 s warm).
source docs/bench/session32/switches.sh
source docs/bench/session37/common.sh
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
python3 -m pip install -q --no-index --no-deps --target /tmp/site_tt .peers/whl/*.whl >/dev/null 2>&1
tt() {
  PYTHONPATH=/tmp/site_tt timeout 110 python3 .peers/torchtitan_moe_bench.py --config $1 --compile --steps 35 \
    --warmup 5 > $OUT/torchtitan_$1_$2.jsonl 2>$OUT/torchtitan_$1_$2.err
  grep '"result"' $OUT/torchtitan_$1_$2.jsonl | cut -c1-420
}
t0=$(date +%s)
tt olmoe3-4l-8e before
echo "torchtitan $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 280 python3 tools/bench_train.py $S2 --steps 30 --warmup 5 --variant best:$BEST --variant f8gc:$F8,$G,$C \
  --variant best_2:$BEST --json $OUT/olmoe3_best_x2_f8gc.json 2>&1 | grep -v Warning | tail -5
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
tt olmoe3-4l-8e after
echo "torchtitan $(( $(date +%s) - t0 )) s"
