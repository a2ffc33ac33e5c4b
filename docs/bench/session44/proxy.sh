#!/usr/bin/env bash
# Session 44, call 3: the second half of eager.sh again (its first run in call 2 lacked MOETRON_PYTHON, so the
# example's set-up tried to pip-install torch and the three runs stopped at once), with one more run: norm and
# RoPE kernels both on. The GPU proxy with the norm off, on, on + RoPE, off again (proxy_runs.sh; as run, this
# script printed the steps 1, 100, 200 instead of 10, 100, 200). Run from the repo root: bash docs/bench/session44/proxy.sh
bash docs/bench/session44/proxy_runs.sh off:"--model.triton_rmsnorm=false" on:"--model.triton_rmsnorm=true" \
  onrope:"--model.triton_rmsnorm=true --model.triton_rope=true" off2:"--model.triton_rmsnorm=false"
