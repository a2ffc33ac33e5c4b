#!/usr/bin/env bash
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
t0=$(date +%s)
timeout 150 python3 -m pytest -q -m gpu tests/core/test_precision_emulated.py tests/core/test_mx.py 2>&1 | tail -4
echo "tests $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 130 python3 tools/bench_quantize.py --mx --json $OUT/quantize_mx.json 2>&1 | grep -v Warning
echo "quantize $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 270 python3 tools/bench_grouped_mm.py --shapes olmo3-moe-8e --passes fwd,dgrad,wgrad --json $OUT/gmm_8e.json > $OUT/gmm_8e.txt 2> $OUT/gmm_8e_err.txt
cat $OUT/gmm_8e.txt; tail -3 $OUT/gmm_8e_err.txt
echo "gmm $(( $(date +%s) - t0 )) s"
