#!/usr/bin/env bash
# The smallest useful call (about 75 s: the session had 311 s of device time left): fp8_rowwise with
# and without quantize_input_once on OLMoE-8L only.
# Run from the repo root through the device tool: bash docs/bench/session28/call3.sh (timeout 100).
source docs/bench/session25/common.sh
NI=precision.quantize_input_once=false
t0=$(date +%s)
timeout 75 python3 tools/bench_train.py $S1 --steps 8 --warmup 3 --variant f8rfc:$F8RFC,$NI \
  --variant f8rfcI:$F8RFC,$I --json $OUT/olmoe8l.json 2>&1 | grep -v Warning | tail -4
echo "train s1 $(( $(date +%s) - t0 )) s"
