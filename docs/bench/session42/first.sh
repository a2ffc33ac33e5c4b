#!/usr/bin/env bash
# Session 42's first call, whichever GPU comes: on an H200 call 2 (#13 against torchtitan), on an H100 call 4
# (the whole GPU suite; the H100 comparison has two same-run samples already). Needs .peers carried.
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash docs/bench/session42/call2.sh
else
  bash docs/bench/session42/call4.sh
fi
