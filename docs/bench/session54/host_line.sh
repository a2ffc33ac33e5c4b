#!/usr/bin/env bash
# Session 54, call 4: tools/profile_step.py's new host line (host_done_ms / gpu_done_ms) on the GPU: OLMoE-8L's
# default, compiled, and eager (a slower host). Run from the repo root: bash docs/bench/session54/host_line.sh
# (timeout 300; about 150 s on a fresh machine)
source docs/bench/session42/common.sh
timeout 120 python3 tools/profile_step.py $S1 --wait 1 --warmup 1 --active 2 --top 5 \
  --json $OUT/profile_S1_host.json 2>&1 | grep -v Warning | grep -E "active steps|GPU idle|host launched|non-GEMM"
timeout 100 python3 tools/profile_step.py ${S1/ --compile/} --wait 1 --warmup 1 --active 2 --top 5 \
  --json $OUT/profile_S1_host_eager.json 2>&1 | grep -v Warning | grep -E "active steps|GPU idle|host launched|non-GEMM"
