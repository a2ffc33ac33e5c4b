#!/usr/bin/env bash
# Session 34's call 3: olmoe3-4l-8e against torchtitan again, with every switch that calls 1-2 kept
# (ALL = D,H,E,S) plus the Triton grad norm (G), the loss in larger chunks (8192 / 16384 tokens) and
# the fused shared-input GEMMs (F);
# OLMoE-8L b16 / ALL / ALL+G / ALL+G+F; first the warp-specialized kernels' bisection
# (docs/bench/session34/ws_bisect.py). Needs .peers carried.
# Run from the repo root: bash docs/bench/session34/call3.sh (timeout 600; about 380 s warm).
source docs/bench/session32/switches.sh
G=optimizer.triton_grad_norm=true
F=precision.fused_shared_input=true
t0=$(date +%s)
timeout 150 python3 docs/bench/session34/ws_bisect.py 2>&1 | grep -v Warning | cut -c1-260
echo "bisect $(( $(date +%s) - t0 )) s"
python3 -m pip install -q --no-index --no-deps --target /tmp/site_tt .peers/whl/*.whl >/dev/null 2>&1
t0=$(date +%s)
PYTHONPATH=/tmp/site_tt timeout 100 python3 .peers/torchtitan_moe_bench.py --config olmoe3-4l-8e --compile --steps 20 \
  --warmup 5 > $OUT/torchtitan_olmoe3.jsonl 2>$OUT/torchtitan_olmoe3.err
grep '"result"' $OUT/torchtitan_olmoe3.jsonl | cut -c1-420
echo "torchtitan $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 200 python3 tools/bench_train.py $S2 --steps 15 --warmup 5 --variant b16:$B16 --variant all:$B16,$ALL \
  --variant allG:$B16,$ALL,$G --variant allG_c8k:$B16,$ALL,$G,model.loss_chunk_tokens=8192 \
  --variant allG_c16k:$B16,$ALL,$G,model.loss_chunk_tokens=16384 --variant allGF:$B16,$ALL,$G,$F \
  --variant b16_again:$B16 \
  --json $OUT/olmoe3_best.json 2>&1 | grep -v Warning | tail -8
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 150 python3 tools/bench_train.py $S1 --steps 12 --warmup 3 --variant b16:$B16 --variant all:$B16,$ALL \
  --variant allG:$B16,$ALL,$G --variant allGF:$B16,$ALL,$G,$F --json $OUT/olmoe8l_best.json 2>&1 | grep -v Warning | tail -5
echo "S1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
