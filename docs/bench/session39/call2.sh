#!/usr/bin/env bash
# trainer.cuda_graph (core/cuda_graph.py) on the GPU: its tests (the replayed step against the eager one,
# bit for bit), then each shape's best bf16 row and f8gc with the step replayed as one CUDA graph and without.
# Run from the repo root: bash docs/bench/session39/call2.sh (timeout 600)
source docs/bench/session32/switches.sh  # session 25's environment, install, B16, S1, S2; ALL
F8=optimizer.state_dtype=bf16,precision.recipe=fp8_blockwise
G=precision.fp8_experts=gluon
C=precision.expert_weight_copies=optimizer,precision.expert_grads_bf16=true
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
CG=trainer.cuda_graph=true
t0=$(date +%s)
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/core/test_cuda_graph.py --tb=short 2>&1 \
  | grep -v Warning | tail -25
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 210 python3 tools/bench_train.py $S2 --steps 8 --warmup 3 --variant best:$BEST --variant best_cg:$BEST,$CG \
  --variant f8gc:$F8,$G,$C --variant f8gc_cg:$F8,$G,$C,$CG --json $OUT/steps_S2.json 2>&1 | grep -v Warning | tail -6
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 200 python3 tools/bench_train.py $S1 --steps 8 --warmup 3 --variant best:$BEST --variant best_cg:$BEST,$CG \
  --variant f8gc:$F8,$G,$C --variant f8gc_cg:$F8,$G,$C,$CG --json $OUT/steps_S1.json 2>&1 | grep -v Warning | tail -6
echo "S1 $(( $(date +%s) - t0 )) s"
