#!/usr/bin/env bash
# Queued by session 56 (its device time spent). Why did olmoe3-4l-8e's ratio fall from 1.21x on the H100s to
# 1.159x on session 56's H200? Its profiles put moetron's GEMMs 4% slower there (653-692 against 674-717 TFLOP/s on
# the same shapes) while the memory-bound kernels ran faster; one guess is a power-capped SM clock under the GEMMs
# (HBM3e beside the same 700 W). This samples the card's SM clock and power once a second
# (nvidia-smi dmon -s pc) while best + SHE and then torchtitan 0.3.0 run, and prints each run's mean clock and power.
# Run it on whichever card comes and say which. First the routing kernels' GPU tests (session 56 added K = 3 and 6).
# Run from the repo root with .peers carried: bash docs/bench/session56/next.sh (timeout 600; about 250 s fresh;
# SKIP_TESTS=1 leaves the tests out)
source docs/bench/session42/common.sh
[ -n "$SKIP_TESTS" ] || MOETRON_PYTHON=$(command -v python3) timeout 120 python3 -m pytest -q -m gpu tests/core/moe/test_kernels.py 2>&1 | tail -1
nvidia-smi dmon -s pc -o T -d 1 > $OUT/dmon.txt 2>&1 &
dmon=$!
sleep 2
echo "ours $(date +%T)" > $OUT/marks.txt
timeout 200 python3 tools/bench_train.py $S2 --steps 30 --warmup 5 --variant best_SHE:$BEST,$SHE \
  --json $OUT/olmoe3_ratio.json 2>&1 | grep -v Warning | tail -2
echo "torchtitan $(date +%T)" >> $OUT/marks.txt
tt olmoe3-4l-8e after 30
echo "end $(date +%T)" >> $OUT/marks.txt
kill $dmon
# Each run's mean SM clock and power over its seconds under load (>= 650 W, tools/clocks.py LOAD_W: each window
# also holds its compile and start-up, idle at 345-1,980 MHz; session 57's call 1 first averaged those in).
python3 tools/clocks.py dmon $OUT/dmon.txt $OUT/marks.txt
python3 tools/peer_ratio.py $OUT/olmoe3_ratio.json --peer $OUT/torchtitan_olmoe3-4l-8e_after.jsonl 2>&1 | tail -2
