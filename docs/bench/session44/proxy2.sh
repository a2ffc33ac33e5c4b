#!/usr/bin/env bash
# Session 44, call 4: the noise the norm's curve is judged against. In call 3 the two runs without the Triton
# norm matched bit for bit through step 10 (the eager step is not reproducible after), so their spread is the
# noise of runs that share their start; the norm (fp32-rounding differences from step 1) needs runs perturbed
# at rounding level from step 1 without it: the fused loss in chunks of 4,096 tokens (another GEMM shape for
# the logits, another order of the loss sums) and the clipping norm summed by Triton (another order).
# Run from the repo root: bash docs/bench/session44/proxy2.sh
bash docs/bench/session44/proxy_runs.sh chunk:"--model.loss_chunk_tokens=4096" gnorm:"--optimizer.triton_grad_norm=true" \
  onchunk:"--model.triton_rmsnorm=true --model.loss_chunk_tokens=4096"
