#!/usr/bin/env bash
# Session 43's first call, whichever GPU comes: on an H200 session 42's call 2 (#13 against torchtitan on the
# GPU its targets were set on), on an H100 call 1 (the GPU tests not yet run on today's code). Needs .peers
# carried for the H200 branch. Run from the repo root: bash docs/bench/session43/first.sh (timeout 600).
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash docs/bench/session42/call2.sh
else
  bash docs/bench/session43/call1.sh
fi
