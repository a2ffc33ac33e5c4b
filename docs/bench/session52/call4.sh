#!/usr/bin/env bash
# Session 52, call 4 (.peers carried): the new default (optimizer.split_master auto, on with the copies) beside
# split_master=false (session 51's default) and the copies off, compiled on both #13 shapes with torchtitan 0.3.0
# after each; trainer.deterministic twice on OLMoE-8L (the same last loss bit for bit, against the default twice;
# its cost); then OLMoE-8L eager, the default beside split_master=false.
# Run from the repo root: bash docs/bench/session52/call4.sh (timeout 600; about 300-400 s)
source docs/bench/session42/common.sh
OFF=precision.expert_weight_copies=none,precision.expert_grads_bf16=false,precision.dense_weight_copies=false,precision.head_weight_copy=false
NS=optimizer.split_master=false
timeout 150 python3 tools/bench_train.py $S2 --steps 30 --warmup 5 --variant default: --variant nosplit:$NS \
  --variant off:$OFF --variant default_2: --json $OUT/olmoe3_default.json 2>&1 | grep -v Warning | tail -5
tt olmoe3-4l-8e after 35
timeout 200 python3 tools/bench_train.py $S1 --steps 12 --warmup 4 --variant default: --variant nosplit:$NS \
  --variant off:$OFF --variant default_2: --variant det:trainer.deterministic=true \
  --variant det_2:trainer.deterministic=true --json $OUT/olmoe8l_default.json 2>&1 | grep -v Warning | tail -7
python3 -c "import json,sys; [print(r['variant'], repr(r['loss_last'])) for r in json.load(open(sys.argv[1]))['rows']]" \
  $OUT/olmoe8l_default.json
tt olmoe-1b-7b-8l after 25
S1E=${S1/--compile/}
timeout 100 python3 tools/bench_train.py $S1E --steps 8 --warmup 3 --variant default: --variant nosplit:$NS \
  --json $OUT/olmoe8l_eager.json 2>&1 | grep -v Warning | tail -3
