#!/usr/bin/env bash
# Session 46: precision.bf16_residual's loss check on the GPU proxy (200 steps, model.triton_rmsnorm on by
# default) at trainer.seed 0, 1, 2, against sessions 44-45's norm-on runs (tools/compare_runs.py --group).
# Any GPU; about 250 s. Run from the repo root: bash docs/bench/session46/proxy_residual.sh (timeout 600)
bash docs/bench/session44/proxy_runs.sh s0_R:"--trainer.seed=0 --precision.bf16_residual=true" \
  s1_R:"--trainer.seed=1 --precision.bf16_residual=true" s2_R:"--trainer.seed=2 --precision.bf16_residual=true"
