source docs/bench/session25/common.sh
F8=optimizer.state_dtype=bf16,precision.recipe=fp8_blockwise
G=precision.fp8_experts=gluon
timeout 70 python3 -m pytest -q -m gpu tests/core/test_fp8_gluon.py -k compiled --tb=long 2>&1 | grep -v Warning | grep -E "Error|error|assert|differ|^E " | head -30
timeout 100 python3 tools/bench_gemm_fp8.py --iters 10 --skip-check --shapes olmoe olmo3-moe-3.2b --no-dense \
  --backends "fp8_blockwise gluon" "fp8_blockwise" --json $OUT/gemm_fp8.json 2>&1 | grep -v Warning | tail -12
timeout 170 python3 tools/bench_train.py $S2 --steps 8 --warmup 3 --variant b16:$B16 --variant f8g:$F8,$G \
  --variant f8:$F8 --json $OUT/steps_S2.json 2>&1 | grep -v Warning | tail -5
