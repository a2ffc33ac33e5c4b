#!/usr/bin/env bash
# Session 32's queued call 2 (not yet run). The same four rows on OLMoE-8L, then #13's olmoe3-4l-8e
# ratio against torchtitan with both switches on (needs .peers carried: ../shared/peers/README.md).
# Run from the repo root: bash docs/bench/session32/call2.sh (timeout 590; about 520 s warm-started).
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
D=precision.dense_weight_copies=true
P=model.fused_loss_prescale=false
t0=$(date +%s)
timeout 280 python3 tools/bench_train.py $S1 --steps 12 --warmup 3 --variant b16:$B16 --variant b16_noP:$B16,$P \
  --variant b16D:$B16,$D --variant b16_again:$B16 --json $OUT/switches_S1.json 2>&1 | grep -v Warning | tail -6
echo "S1 $(( $(date +%s) - t0 )) s"
python3 -m pip install -q --no-index --no-deps --target /tmp/site_tt .peers/whl/*.whl >/dev/null 2>&1
t0=$(date +%s)
PYTHONPATH=/tmp/site_tt timeout 120 python3 .peers/torchtitan_moe_bench.py --config olmoe3-4l-8e --compile --steps 20 \
  --warmup 5 > $OUT/torchtitan_olmoe3.jsonl 2>$OUT/torchtitan_olmoe3.err
grep '"result"' $OUT/torchtitan_olmoe3.jsonl | cut -c1-420; tail -2 $OUT/torchtitan_olmoe3.err | cut -c1-300
echo "torchtitan $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 150 python3 tools/bench_train.py $S2 --steps 15 --warmup 5 --variant b16:$B16 --variant b16D:$B16,$D \
  --json $OUT/olmoe3_vs_tt.json 2>&1 | grep -v Warning | tail -4
echo "moetron $(( $(date +%s) - t0 )) s"
