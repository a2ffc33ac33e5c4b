#!/usr/bin/env bash
# Session 40 call 5: precision.fp8_gluon_group (new this session: the Gluon FP8 rows kernel's raster in
# groups of row tiles) in a step. Call 1's kernel sweep reached only OLMoE's shapes (groups of 8: forward
# 1.035x, dgrad 0.95-1.0x); olmoe3-4l-8e's experts (E 8, 32 MiB of e4m3 weights an expert, past L2) are
# where grouping should matter: its kernel sweep first (groups 1 and 8), then both shapes' f8gc with
# groups 1 (the default), 8 and 4, twice each where time allows. The losses of g1 and g8 must agree bit
# for bit (the raster changes which CTA computes a tile, not the tile's sums).
# Run from the repo root: bash docs/bench/session40/call5.sh (timeout 600)
source docs/bench/session37/common.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 150 python3 tools/bench_fp8_variants.py --shapes olmo3-moe-8e --gemms gate_up,down --iters 10 --loop 10 \
  --gluon-configs "4,1,1,1;4,1,1,8" --gluon-k-configs "4,1,1" --json $OUT/gluon_groups_olmoe3.json 2>&1 \
  | grep -v Warning | tail -8
echo "olmoe3 groups $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
GG=precision.fp8_gluon_group
timeout 170 python3 tools/bench_train.py $S2 --steps 10 --warmup 3 --variant g1:$F8,$G,$C --variant g8:$F8,$G,$C,$GG=8 \
  --variant g4:$F8,$G,$C,$GG=4 --variant g1_2:$F8,$G,$C --variant g8_2:$F8,$G,$C,$GG=8 --json $OUT/steps_S2.json 2>&1 \
  | grep -v Warning | tail -6
echo "S2 $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
timeout 130 python3 tools/bench_train.py $S1 --steps 10 --warmup 3 --variant g1:$F8,$G,$C --variant g8:$F8,$G,$C,$GG=8 \
  --variant g1_2:$F8,$G,$C --variant g8_2:$F8,$G,$C,$GG=8 --json $OUT/steps_S1.json 2>&1 | grep -v Warning | tail -5
echo "S1 $(( $(date +%s) - t0 )) s"
