#!/usr/bin/env bash
# Session 44, call 5 (queued): each norm of the proxy's model on its real inputs (norm_io.py), the norm's
# gradients against the torch path and a rounding control on the proxy's model (gradcmp.py), then
# olmoe3-4l-8e's eager best row profiled with the norm and RoPE kernels (the next eager levers).
# Run from the repo root: bash docs/bench/session44/call5.sh (timeout 300; about 200 s on a fresh machine)
source docs/bench/session32/switches.sh
timeout 60 python3 docs/bench/session44/norm_io.py cuda 2>&1 | grep -v Warning | tail -17
timeout 90 python3 docs/bench/session44/gradcmp.py 2>&1 | grep -v Warning | tail -4
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384,model.triton_rmsnorm=true
timeout 110 python3 tools/profile_step.py ${S2/ --compile/} $(echo "$BEST" | tr ',' '\n' | sed 's/^/--/' | tr '\n' ' ') \
  --wait 1 --warmup 1 --active 1 --top 30 --json $OUT/profile_S2_eager_norm_rope.json 2>&1 | grep -v Warning | tail -45
