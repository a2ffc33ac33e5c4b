#!/usr/bin/env bash
# fp8_rowwise with and without quantize_input_once on both shapes, about 200 s at most: call1.sh
# runs it after its GPU test; alone, for a short budget.
# Run from the repo root through the device tool: bash docs/bench/session28/call2.sh (timeout 230).
source docs/bench/session25/common.sh
NI=precision.quantize_input_once=false
t0=$(date +%s)
timeout 65 python3 tools/bench_train.py $S1 --steps 8 --warmup 3 --variant f8rfc:$F8RFC,$NI \
  --variant f8rfcI:$F8RFC,$I --json $OUT/olmoe8l.json 2>&1 | grep -v Warning | tail -4
echo "train s1 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 130 python3 tools/bench_train.py $S2 --steps 6 --warmup 3 --variant f8rfc:$F8RFC,$NI --variant f8rfcI:$F8RFC,$I \
  --json $OUT/olmoe3.json 2>&1 | grep -v Warning | tail -4
echo "train s2 $(( $(date +%s) - t0 )) s"
