#!/usr/bin/env bash
# Session 54, call 3: is OLMoE-8L's default step host-bound on some machines? Session 53's profile of the default
# showed 14.5 ms of GPU idle a step (session 51's, split_master off, 5.9) and its unprofiled default ran 203.0 ms
# against 193.5 ms of kernels, where session 52's and 54's machines ran 195.8 / 194.4 ms. On one machine: the
# default's profile, then the default, the step replayed as one CUDA graph (trainer.cuda_graph: no host launches)
# and the default again, one process. A host-bound default would run slower than its graph.
# Run from the repo root: bash docs/bench/session54/host_probe.sh (timeout 420; about 250 s on a fresh machine)
source docs/bench/session42/common.sh
t0=$(date +%s)
timeout 150 python3 tools/profile_step.py $S1 --wait 1 --warmup 1 --active 2 --top 12 \
  --json $OUT/profile_S1_default.json 2>&1 | grep -v Warning | grep -E "active steps|GPU idle|non-GEMM" | head -4
echo "profile $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 200 python3 tools/bench_train.py $S1 --steps 10 --warmup 3 --variant default: \
  --variant cg:trainer.cuda_graph=true --variant default_2: --json $OUT/host_S1.json 2>&1 | grep -v Warning | tail -4
echo "bench $(( $(date +%s) - t0 )) s"
