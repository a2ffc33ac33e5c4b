#!/usr/bin/env bash
# Session 43's second call, whichever GPU comes. On an H200: session 42's call 2 (#13 against torchtitan on
# the GPU its targets were set on; .peers carried). On an H100: the whole GPU suite in one call, three
# pytest-xdist workers sharing the GPU (tools/run_tests.sh, modules kept whole, the slow ones first): session
# 42 found that one process gets through 88 of its 113 tests in 560 s.
# Run from the repo root: bash docs/bench/session43/call2.sh (timeout 600).
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash docs/bench/session42/call2.sh
  exit
fi
source docs/bench/session25/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import xdist; print('xdist', xdist.__version__)"
t0=$(date +%s)
MOETRON_PYTHON=python3 MOETRON_TEST_WORKERS=3 timeout 560 bash tools/run_tests.sh -m gpu -q -p no:cacheprovider \
  --durations=15 --tb=short --junitxml=$OUT/gpu_all.xml 2>&1 | grep -v "Warning\|DEBUG\|warnings.warn" | tail -45
echo "suite $(( $(date +%s) - t0 )) s"
