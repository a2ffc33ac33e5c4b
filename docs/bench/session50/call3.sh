#!/usr/bin/env bash
# Session 50, call 3: the whole GPU suite on the weight copies' new default (precision.expert_weight_copies,
# expert_grads_bf16, dense_weight_copies, head_weight_copy auto: on for bf16 on one GPU with one micro-batch), so
# every GPU test that builds through build_trainer with the defaults now runs with the optimizer's copies.
# Run from the repo root: bash docs/bench/session50/call3.sh (timeout 600; about 330 s)
source docs/bench/session25/common.sh
git log --oneline -1
t0=$(date +%s)
MOETRON_PYTHON=$(command -v python3) MOETRON_TEST_WORKERS=3 timeout 540 bash tools/run_tests.sh -m gpu -q 2>&1 | grep -v Warning | tail -25
echo "GPU suite $(( $(date +%s) - t0 )) s"
