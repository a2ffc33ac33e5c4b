#!/usr/bin/env bash
# Queued by session 44: model.triton_rmsnorm's default, with independent samples. Session 44's proxy runs that
# shared their first 10 steps ended close together (the early steps decide much: which experts starve), so
# its seven runs were five independent trajectories, the norm's two both above the three without it (p = 0.1
# by rank). Here two more seeds of the initial weights (trainer.seed; the data order, data.seed, kept), the
# norm off and on for each: with session 44's seed-0 runs, three pairs. Any GPU; about 320 s.
# Run from the repo root: bash docs/bench/session45/proxy3.sh (timeout 600)
bash docs/bench/session44/proxy_runs.sh s1_off:"--trainer.seed=1 --model.triton_rmsnorm=false" \
  s1_on:"--trainer.seed=1 --model.triton_rmsnorm=true" s2_off:"--trainer.seed=2 --model.triton_rmsnorm=false" \
  s2_on:"--trainer.seed=2 --model.triton_rmsnorm=true"
