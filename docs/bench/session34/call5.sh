#!/usr/bin/env bash
# Session 34's call 5 (the budget's last): olmoe3-4l-8e against torchtitan once more with the best
# rows of call 3 (b16; ALL + G with the loss in one 16,384-token chunk), that row's profile, then the
# warp-specialized FP8 kernels with 64-row tiles (right on the H100, but Triton 3.6 runs each tile in
# both consumers) timed beside the pipelined kernels and bf16.
# Run from the repo root: bash docs/bench/session34/call5.sh (timeout 330; carry .peers).
source docs/bench/session32/switches.sh
G=optimizer.triton_grad_norm=true
C=model.loss_chunk_tokens=16384
python3 -m pip install -q --no-index --no-deps --target /tmp/site_tt .peers/whl/*.whl >/dev/null 2>&1
t0=$(date +%s)
PYTHONPATH=/tmp/site_tt timeout 80 python3 .peers/torchtitan_moe_bench.py --config olmoe3-4l-8e --compile --steps 20 \
  --warmup 5 > $OUT/torchtitan_olmoe3.jsonl 2>$OUT/torchtitan_olmoe3.err
grep '"result"' $OUT/torchtitan_olmoe3.jsonl | cut -c1-420
echo "torchtitan $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 90 python3 tools/bench_train.py $S2 --steps 15 --warmup 5 --variant b16:$B16 --variant best:$B16,$ALL,$G,$C \
  --json $OUT/olmoe3_best.json 2>&1 | grep -v Warning | tail -3
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 60 python3 tools/profile_step.py $S2 --optimizer.state_dtype=bf16 --precision.expert_weight_copies=optimizer \
  --precision.expert_grads_bf16=true --$D --$H --$E --$S --$G --$C --wait 1 --warmup 1 --active 2 --top 12 \
  --json $OUT/profile_best.json 2>&1 | grep -v Warning | head -22
echo "profile $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 60 python3 tools/bench_fp8_variants.py --ws --shapes olmoe --gemms gate_up --iters 10 \
  --json $OUT/variants.json 2>&1 | grep -v Warning | tail -10
echo "variants $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 90 python3 -m pytest -q -m gpu tests/core/test_precision_fp8.py -k "warp_specialized or triton_ws" 2>&1 | tail -3
echo "tests $(( $(date +%s) - t0 )) s"
