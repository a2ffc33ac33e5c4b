#!/usr/bin/env bash
# Queued by session 53 (no machine could be started for it). SUITE=1: the whole GPU suite on session 53's code
# (trainer.deterministic's fill off, the fp8 autotune bits test, PrecisionAwareAdamW's fp32 default):
# bash docs/bench/session52/call3.sh. Otherwise call 4: the change's GPU tests, the GPU proxy twice with
# trainer.deterministic, OLMoE-8L's default beside it.
# Run from the repo root: SUITE=1 bash docs/bench/session53/next.sh (timeout 600; about 400 s), then
# bash docs/bench/session53/next.sh (timeout 600; about 330 s warm)
if [[ -n "${SUITE:-}" ]]; then
  exec bash docs/bench/session52/call3.sh
fi
exec bash docs/bench/session53/call4.sh
