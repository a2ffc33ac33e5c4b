#!/usr/bin/env bash
# trainer.cuda_graph where the host matters more than in calls 2-3: the eager step (no torch.compile) of
# both shapes, and the compiled OLMoE-8L step at batch 1 (4,096 tokens a step), each with the step
# replayed as one CUDA graph and without.
# Run from the repo root: bash docs/bench/session39/call5.sh (timeout 600)
source docs/bench/session32/switches.sh
CG=trainer.cuda_graph=true
t0=$(date +%s)
timeout 150 python3 tools/bench_train.py ${S1/--compile/} --steps 8 --warmup 3 --variant b16:$B16 --variant b16_cg:$B16,$CG \
  --json $OUT/steps_S1_eager.json 2>&1 | grep -v Warning | tail -3
echo "S1 eager $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 150 python3 tools/bench_train.py ${S2/--compile/} --steps 8 --warmup 3 --variant b16:$B16 --variant b16_cg:$B16,$CG \
  --json $OUT/steps_S2_eager.json 2>&1 | grep -v Warning | tail -3
echo "S2 eager $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 150 python3 tools/bench_train.py $S1 --batch 1 --steps 10 --warmup 3 --variant b16:$B16 --variant b16_cg:$B16,$CG \
  --json $OUT/steps_S1_batch1.json 2>&1 | grep -v Warning | tail -3
echo "S1 batch 1 $(( $(date +%s) - t0 )) s"
