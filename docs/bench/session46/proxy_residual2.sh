#!/usr/bin/env bash
# Session 46 call 4: seed 0's bf16_residual proxy run again (call 3's stopped at 130 s, in phase 2: its
# throughput was the norm-off runs' ~360k tok/s, not the norm-on runs' ~460k), and seed 0 without it on the
# same machine as the throughput control. Run from the repo root: bash docs/bench/session46/proxy_residual2.sh
PROXY_TIMEOUT=200 bash docs/bench/session44/proxy_runs.sh s0_R:"--trainer.seed=0 --precision.bf16_residual=true" \
  s0_on:"--trainer.seed=0"
