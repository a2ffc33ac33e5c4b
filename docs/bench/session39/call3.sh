#!/usr/bin/env bash
# #13 on olmoe3-4l-8e against torchtitan with trainer.cuda_graph (call 2: best_cg 1.011x best): torchtitan
# before and after, moetron's best row and best + the CUDA-graph step alternating twice, 30 timed steps
# each (session 35 call 7's form). Needs .peers carried.
# Run from the repo root: bash docs/bench/session39/call3.sh (timeout 600; about 500 s warm).
source docs/bench/session32/switches.sh
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
CG=trainer.cuda_graph=true
python3 -m pip install -q --no-index --no-deps --target /tmp/site_tt .peers/whl/*.whl >/dev/null 2>&1
tt() {
  PYTHONPATH=/tmp/site_tt timeout 110 python3 .peers/torchtitan_moe_bench.py --config olmoe3-4l-8e --compile --steps 35 \
    --warmup 5 > $OUT/torchtitan_$1.jsonl 2>$OUT/torchtitan_$1.err
  grep '"result"' $OUT/torchtitan_$1.jsonl | cut -c1-420
}
t0=$(date +%s)
tt before
echo "torchtitan $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 300 python3 tools/bench_train.py $S2 --steps 30 --warmup 5 --variant best:$BEST --variant best_cg:$BEST,$CG \
  --variant best_2:$BEST --variant best_cg_2:$BEST,$CG --json $OUT/olmoe3_best_cg_x2.json 2>&1 | grep -v Warning | tail -5
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
tt after
echo "torchtitan $(( $(date +%s) - t0 )) s"
