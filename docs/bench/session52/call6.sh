#!/usr/bin/env bash
# Session 52, call 6: call 5 cut to what the device time left allows (machines were scarce). The whole GPU suite on
# optimizer.split_master's auto as the default (its freed parameters guarded: core/split_param.py) and
# trainer.deterministic's GPU test; then (.peers carried) on OLMoE-8L compiled: the new default, split_master=false,
# the default again and trainer.deterministic twice (the same last loss bit for bit or not; its cost); torchtitan
# 0.3.0 after.
# Run from the repo root: bash docs/bench/session52/call6.sh (timeout 500; about 420 s)
source docs/bench/session42/common.sh
t0=$(date +%s)
MOETRON_PYTHON=$(command -v python3) MOETRON_TEST_WORKERS=3 timeout 290 bash tools/run_tests.sh -m gpu -q 2>&1 \
  | grep -v Warning | grep -E "passed|failed|FAILED|Error" | tail -25
echo "GPU suite $(( $(date +%s) - t0 )) s"
NS=optimizer.split_master=false
timeout 150 python3 tools/bench_train.py $S1 --steps 12 --warmup 4 --variant default: --variant nosplit:$NS \
  --variant default_2: --variant det:trainer.deterministic=true --variant det_2:trainer.deterministic=true \
  --json $OUT/olmoe8l_default.json 2>&1 | grep -v Warning | tail -6
python3 -c "import json,sys; [print(r['variant'], repr(r['loss_last'])) for r in json.load(open(sys.argv[1]))['rows']]" \
  $OUT/olmoe8l_default.json
tt olmoe-1b-7b-8l after 25
echo "total $(( $(date +%s) - t0 )) s"
