#!/usr/bin/env bash
# Session 57's first call: session 56's three queued scripts in one call (few starts succeed, each costs 90-270 s):
# the card's limits, next.sh (routing GPU tests; SM clock and power under olmoe3's best + SHE and torchtitan; the
# ratio), loss_stages.sh (the loss row kernel's NUM_STAGES sweep), then inductor_bw.sh on OLMoE-8L alone (the shape
# whose share misses). Run from the repo root with .peers carried: bash docs/bench/session57/call1.sh (about 500 s).
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,power.limit,power.max_limit,clocks.max.sm,clocks.max.mem --format=csv | tee $OUT/card.txt
pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -1
bash docs/bench/session56/next.sh
echo "==== loss stages"
bash docs/bench/session56/loss_stages.sh
echo "==== inductor bandwidth, OLMoE-8L"
SHAPES=S1 bash docs/bench/session56/inductor_bw.sh
