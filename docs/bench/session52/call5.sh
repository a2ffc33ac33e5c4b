#!/usr/bin/env bash
# Session 52, call 5: calls 3 and 4 in one (machines were scarce: one start for both). The whole GPU suite on
# optimizer.split_master's auto as the default (its freed parameters guarded: core/split_param.py) and
# trainer.deterministic's GPU test; then (.peers carried) the new default beside split_master=false (session 51's
# default) and the copies off, compiled on both #13 shapes, torchtitan 0.3.0 after each; on OLMoE-8L the default
# twice and trainer.deterministic twice (the same last loss bit for bit or not; its cost).
# Run from the repo root: bash docs/bench/session52/call5.sh (timeout 600; about 560 s)
source docs/bench/session42/common.sh
t0=$(date +%s)
MOETRON_PYTHON=$(command -v python3) MOETRON_TEST_WORKERS=3 timeout 300 bash tools/run_tests.sh -m gpu -q 2>&1 \
  | grep -v Warning | grep -E "passed|failed|FAILED|Error" | tail -25
echo "GPU suite $(( $(date +%s) - t0 )) s"
OFF=precision.expert_weight_copies=none,precision.expert_grads_bf16=false,precision.dense_weight_copies=false,precision.head_weight_copy=false
NS=optimizer.split_master=false
timeout 200 python3 tools/bench_train.py $S1 --steps 12 --warmup 4 --variant default: --variant nosplit:$NS \
  --variant off:$OFF --variant default_2: --variant det:trainer.deterministic=true \
  --variant det_2:trainer.deterministic=true --json $OUT/olmoe8l_default.json 2>&1 | grep -v Warning | tail -7
python3 -c "import json,sys; [print(r['variant'], repr(r['loss_last'])) for r in json.load(open(sys.argv[1]))['rows']]" \
  $OUT/olmoe8l_default.json
tt olmoe-1b-7b-8l after 25
timeout 100 python3 tools/bench_train.py $S2 --steps 30 --warmup 5 --variant default: --variant nosplit:$NS \
  --variant off:$OFF --json $OUT/olmoe3_default.json 2>&1 | grep -v Warning | tail -4
tt olmoe3-4l-8e after 35
echo "total $(( $(date +%s) - t0 )) s"
