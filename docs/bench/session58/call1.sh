#!/usr/bin/env bash
# Session 58's call (meant for an H200; whichever card comes is named in card.txt). Session 57's queued call2.sh and
# session 55's ratios.sh in one call, trimmed to fit 600 s:
# 1. (ran as 26ae13e: the loss row kernel's PROGRAMS sweep; gone with the knob since d9b5a57, the sweep's results
#    in call2/);
# 2. tools/bench_gemm_clock.py: two of olmoe3's dense GEMMs in a burst and held for 5 s, beside the clock and power
#    (the card's own held GEMM rate under its cap, apart from any step);
# 3. nvidia-smi dmon once a second over every run below, each run's start in marks.txt; tools/clocks.py dmon
#    prints each run's mean SM clock and power under load (is an H200 power-capped too, and at what clock?);
# 4. #13's two ratios: olmoe3-4l-8e (default, best + SHE; 30 steps) then torchtitan 0.3.0, OLMoE-8L (default,
#    best + SHE; 12 steps) then torchtitan. bench_train's rows carry their own clock samples (tools/clocks.py's
#    ClockSampler, first run on a GPU here): compare sm_clock_mhz with dmon's figure for the same run.
# (Its pairs as docs/bench/session42/common.sh's ratio_pairs since session 59; the same runs.)
# Run from the repo root with .peers carried: bash docs/bench/session58/call1.sh (about 440 s fresh;
# SKIP_S1=1 leaves the OLMoE-8L pair out: about 260 s; SKIP_S2_DEFAULT=1 too: about 130 s).
source docs/bench/session42/common.sh
nvidia-smi --query-gpu=name,power.limit,power.max_limit,clocks.max.sm,clocks.max.mem --format=csv | tee $OUT/card.txt
t0=$(date +%s)
timeout 60 python3 tools/bench_gemm_clock.py --json $OUT/gemm_clock.json 2>&1 | grep -v Warning
echo "gemm clock $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
S2_DEFAULT="--variant default:"; [ -z "${SKIP_S2_DEFAULT:-}" ] || S2_DEFAULT=""
ratio_pairs ratio "$S2_DEFAULT --variant best_SHE:$BEST,$SHE" "--variant default: --variant best_SHE:$BEST,$SHE"
