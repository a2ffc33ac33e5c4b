#!/usr/bin/env bash
# Session 50, call 5 (.peers carried): call 3's five GPU failures again after the fixes (the overlap test pins the
# copies off in both runs; auto needs ParallelConfig.one_rank: no strategy asked for by name, so the pipeline's
# runtime on one rank keeps them off), with their errors; then call 4 (the new default against the copies off,
# torchtitan in the same run, the GPU proxy at seeds 0 and 1).
# Run from the repo root: bash docs/bench/session50/call5.sh (timeout 600)
source docs/bench/session25/common.sh
t0=$(date +%s)
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -W ignore \
  tests/core/test_dense_copies.py tests/core/test_overlap.py \
  "tests/parallel/test_precision_layouts.py::test_pipeline_runtime_on_gpu_bf16" 2>&1 \
  | grep -E "^E  |Error|passed|failed|^tests.*(FAIL|PASS)|assert" | head -40
echo "GPU tests $(( $(date +%s) - t0 )) s"
bash docs/bench/session50/call4.sh
