#!/usr/bin/env bash
# Session 55, call 6: #13's non-GEMM, non-attention share with tools/profile_step.py counting what an attention
# backend launches inside its own op as attention (cuDNN's backward helper passes, D = rowsum(dO * O) and the dQ
# conversion, and its fills; "other" and "fill" before): the default and best + SHE on both #13 shapes, compiled.
# --top 60 lists the moved kernels, so the share before the change is read off the same profile.
# Run from the repo root: bash docs/bench/session55/shares.sh (timeout 600; about 300 s on a fresh machine).
source docs/bench/session42/common.sh
O=$(flags "$BEST,$SHE")
for shape in S1 S2; do
  for row in default best_SHE; do
    [[ $row == default ]] && extra="" || extra=$O
    timeout 140 python3 tools/profile_step.py ${!shape} $extra --wait 1 --warmup 1 --active 2 --top 60 \
      --json $OUT/profile_${shape}_$row.json 2>&1 | grep -v Warning | grep -E "active steps|^(attention|other|fill) |share"
  done
done
