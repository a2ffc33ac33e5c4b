#!/usr/bin/env bash
# Session 56, call 4 (.peers carried): a second same-run sample of olmoe3-4l-8e against torchtitan 0.3.0 on the
# H200 (call 3 gave best + SHE 1.159x, missing 1.2x), torchtitan on both sides of ours, then best + SHE profiled
# (#13's share on the H200) and the card's clocks and power limits.
# Run from the repo root: bash docs/bench/session56/call4.sh (timeout 600; about 250 s on a fresh machine).
source docs/bench/session42/common.sh
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm,power.limit,power.max_limit,temperature.gpu --format=csv
tt olmoe3-4l-8e before 30
timeout 200 python3 tools/bench_train.py $S2 --steps 30 --warmup 5 --variant best_SHE:$BEST,$SHE --variant default: \
  --json $OUT/olmoe3_ratio.json 2>&1 | grep -v Warning | tail -3
tt olmoe3-4l-8e after 30
O=$(flags "$BEST,$SHE")
timeout 100 python3 tools/profile_step.py $S2 $O --wait 1 --warmup 1 --active 2 --top 60 \
  --json $OUT/profile_S2_best_SHE.json 2>&1 | grep -v Warning | grep -E "active steps|^(attention|optimizer|gemm) |share"
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv
