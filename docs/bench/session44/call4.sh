#!/usr/bin/env bash
# Session 44, call 4 (on session 44's tree: model.triton_rope on by default): the noise the norm's curve is
# judged against (proxy2.sh: two runs without the norm perturbed at rounding level from step 1, and the norm
# with one of those perturbations); then on an H200 #13's same-run comparison (session 42's call2.sh,
# .peers carried), elsewhere the cuda_graph GPU tests with the RoPE kernel now on by default in the eager
# step they capture. Run from the repo root: bash docs/bench/session44/call4.sh (timeout 600)
nvidia-smi --query-gpu=name --format=csv,noheader
bash docs/bench/session44/proxy2.sh
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  t0=$(date +%s); bash docs/bench/session42/call2.sh 2>&1 | grep -v Warning | tail -20; echo "call2 $(( $(date +%s) - t0 )) s"
else
  t0=$(date +%s)
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/core/test_cuda_graph.py tests/core/test_rope_triton.py \
    --junitxml=$OUT/cuda_graph.xml 2>&1 | tail -2
  echo "tests $(( $(date +%s) - t0 )) s"
fi
