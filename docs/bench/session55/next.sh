#!/usr/bin/env bash
# Queued by session 55 (no device time left for it): the planner's DETERMINISTIC_ATTN (attention's kernel time
# under trainer.deterministic against the default's, 2.37) is measured on OLMoE-8L only (session 53, head dim 128,
# 16 heads without grouping). olmoe3-4l-8e has grouped-query attention (32 query heads over 8 KV heads, whose dK and
# dV the backward sums per group), so its ratio may differ. Profile it with and without the switch (attention ms a
# step from the category table), then its tokens/s with and without, and the planner against those rows.
# First, session 55's routing change (core/moe/kernels/routing.py: the per-block counts expert-major, so the
# cross-block scan runs along the innermost dimension; bit-exact under TRITON_INTERPRET=1, not yet run on a GPU):
# the routing kernels' GPU tests, the two scans alone, and OLMoE-8L's default profiled (session 55's call 6 had
# `tensor_kernel_scan_outer_dim` 0.73 ms a step in "other", 0.87 ms in all; it should be gone from the top kernels),
# and _zero_unwritten_rows checking 256 rows a program (41 us a call, 16 calls a step in call 6): alone, dropless and
# with holes, then in the profile.
# Run from the repo root: bash docs/bench/session55/next.sh (timeout 600; about 330 s on a fresh machine)
source docs/bench/session42/common.sh
MOETRON_PYTHON=$(command -v python3) timeout 150 python3 -m pytest -q -m gpu tests/core/moe/test_kernels.py \
  tests/core/moe/test_moe_gpu.py 2>&1 | tail -2
python3 - <<'PY'
# The two changed pieces alone, timed by the benchmarks' one per-call timer (tools/cli.py median_ms, 50 calls
# queued a sample: GPU time): the cross-block scan in either layout at OLMoE-8L's [512 blocks, 64 experts]; and
# _zero_unwritten_rows (flags and zeroing) on OLMoE-8L's [131072, 2048] bf16 buffer, dropless and with 25% of the rows
# unwritten (a capacity plan's tail: the path the change may have slowed).
import sys
import torch
sys.path.insert(0, "tools")
from cli import median_ms
from moetron.core.moe.kernels import routing
c = torch.randint(0, 9, (512, 64), dtype=torch.int32, device="cuda")
for name, x, dim in (("[B, E] along 0 (before)", c, 0), ("[E, B] along 1 (now)", c.t().contiguous(), 1)):
    print(f"cumsum {name}: {1e3 * median_ms(lambda: x.cumsum(dim, dtype=torch.int32), 'cuda', loop=50):.1f} us")
R, D = 131072, 2048
out = torch.empty(R, D, dtype=torch.bfloat16, device="cuda")
_, block_d, warps = routing._row_blocks(D, 2)
for name, n in (("dropless", R), ("25% holes", R * 3 // 4)):
    dest = torch.randperm(R, device="cuda")[:n].to(torch.int32).view(-1, 8)
    us = 1e3 * median_ms(lambda: routing._zero_unwritten_rows(out, dest, block_d, warps), "cuda", loop=50)
    print(f"_zero_unwritten_rows {name}: {us:.1f} us a call")
PY
timeout 150 python3 tools/profile_step.py $S1 --wait 1 --warmup 1 --active 2 --top 60 \
  --json $OUT/profile_S1_default.json 2>&1 | grep -v Warning | grep -E "active steps|^(routing|other) |scan|zero_unwritten|share"
for row in default det; do
  [[ $row == det ]] && extra=--trainer.deterministic=true || extra=
  timeout 150 python3 tools/profile_step.py $S2 $extra --wait 1 --warmup 1 --active 2 --top 10 \
    --json $OUT/profile_S2_$row.json 2>&1 | grep -v Warning | grep -E "active steps|^attention |share"
done
timeout 200 python3 tools/bench_train.py $S2 --steps 12 --warmup 4 --variant default: \
  --variant det:trainer.deterministic=true --json $OUT/det_S2.json 2>&1 | grep -v Warning | tail -3
python3 tools/plan.py --validate $OUT/det_S2.json --gpu h100 2>&1 | tail -6
