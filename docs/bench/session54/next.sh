#!/usr/bin/env bash
# Queued by session 54: the unprofiled host's own time for OLMoE-8L's default step. The same step (8 layers, 64
# experts top-8, 16,384 tokens, the same switches: the same ops, launches and Python) at tiny widths, where the
# GPU's work is a few ms, so the step waits on the host: its step time is the host's. Beside it the step
# replayed as one CUDA graph (the GPU's floor for those launches) and eager; then profile_step's kernel count
# (it must match the full-width step's, about 1,290 a step compiled: docs/bench/session54/call4) and host line.
# Compare with the full-width step's 197 ms (call 3): a host far under it has room on faster GPUs.
# Run from the repo root: bash docs/bench/session54/next.sh (timeout 400; about 200 s on a fresh machine)
source docs/bench/session42/common.sh
TINY="--preset olmoe-1b-7b --model.n_layers=8 --model.vocab_size=1024 --model.d_model=128 --model.attention.n_heads=2
  --model.moe.expert_hidden=64 --seq-len 4096 --batch 4"
timeout 150 python3 tools/bench_train.py $TINY --compile --steps 20 --warmup 5 --variant default: \
  --variant cg:trainer.cuda_graph=true --json $OUT/host_floor_compiled.json 2>&1 | grep -v Warning | tail -3
timeout 100 python3 tools/bench_train.py $TINY --steps 20 --warmup 5 --variant eager: \
  --json $OUT/host_floor_eager.json 2>&1 | grep -v Warning | tail -2
timeout 100 python3 tools/profile_step.py $TINY --compile --wait 1 --warmup 1 --active 2 --top 3 \
  --json $OUT/host_floor_profile.json 2>&1 | grep -v Warning | grep -E "active steps|^total|GPU idle|host launched"
