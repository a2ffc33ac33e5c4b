#!/usr/bin/env bash
# Queued by session 55 (no device time left for it): the planner's DETERMINISTIC_ATTN (attention's kernel time
# under trainer.deterministic against the default's, 2.37) is measured on OLMoE-8L only (session 53, head dim 128,
# 16 heads without grouping). olmoe3-4l-8e has grouped-query attention (32 query heads over 8 KV heads, whose dK and
# dV the backward sums per group), so its ratio may differ. Profile it with and without the switch (attention ms a step from the category table), then
# its tokens/s with and without, and the planner against those rows.
# Run from the repo root: bash docs/bench/session55/next.sh (timeout 600; about 250 s on a fresh machine)
source docs/bench/session42/common.sh
for row in default det; do
  [[ $row == det ]] && extra=--trainer.deterministic=true || extra=
  timeout 150 python3 tools/profile_step.py $S2 $extra --wait 1 --warmup 1 --active 2 --top 10 \
    --json $OUT/profile_S2_$row.json 2>&1 | grep -v Warning | grep -E "active steps|^attention |share"
done
timeout 200 python3 tools/bench_train.py $S2 --steps 12 --warmup 4 --variant default: \
  --variant det:trainer.deterministic=true --json $OUT/det_S2.json 2>&1 | grep -v Warning | tail -3
python3 tools/plan.py --validate $OUT/det_S2.json --gpu h100 2>&1 | tail -6
