# Sourced by this directory's calls: sessions 32 and 37's environment, install and variant strings, BEST
# (#13's best bf16 row), SHE, flags VARIANT (a variant string as flags) and tt CONFIG TAG STEPS (torchtitan 0.3.0
# from .peers, compiled, 5 warm-up steps).
source docs/bench/session32/switches.sh
source docs/bench/session37/common.sh
BEST=$B16,$ALL,optimizer.triton_grad_norm=true,model.loss_chunk_tokens=16384
# SHE: sessions 47-48's three switches beside BEST (#13's best row: BEST,SHE; sessions 49-55)
SHE=optimizer.split_master=true,precision.head_grads_bf16=true,precision.embedding_weight_copy=true
# flags "a.b=1,c.d=2" -> "--a.b=1 --c.d=2 ": a variant string as the tools' own flags (profile_step.py, bench_train.py)
flags() { echo "$1" | tr ',' '\n' | sed 's/^/--/' | tr '\n' ' '; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site_tt .peers/whl/*.whl >/dev/null 2>&1
tt() {
  PYTHONPATH=/tmp/site_tt timeout 110 python3 .peers/torchtitan_moe_bench.py --config $1 --compile --steps $3 \
    --warmup 5 > $OUT/torchtitan_$1_$2.jsonl 2>$OUT/torchtitan_$1_$2.err
  grep '"result"' $OUT/torchtitan_$1_$2.jsonl | cut -c1-420
}
# mark NAME: NAME and the time into $OUT/marks.txt (tools/clocks.py dmon's windows)
mark() { echo "$1 $(date +%T)" >> $OUT/marks.txt; }
# ratio_pairs TAG "S2 VARIANT FLAGS" ["S1 VARIANT FLAGS"]: #13's ratio pairs under nvidia-smi dmon: olmoe3-4l-8e
# (bench_train, 30 steps, 5 warm-up; $OUT/olmoe3_TAG.json) then torchtitan; OLMoE-8L (12 steps, 4 warm-up;
# $OUT/olmoe8l_TAG.json) then torchtitan, unless its flags are empty or SKIP_S1 is set; then each run's clock and
# power under load (tools/clocks.py dmon) and the ratios (tools/peer_ratio.py). Sessions 58-59's calls.
ratio_pairs() {
  local tag=$1 s2=$2 s1=${3:-} t0 dmon
  t0=$(date +%s)
  nvidia-smi dmon -s pc -o T -d 1 > $OUT/dmon.txt 2>&1 &
  dmon=$!
  sleep 2
  mark olmoe3
  timeout 170 python3 tools/bench_train.py $S2 --steps 30 --warmup 5 $s2 --json $OUT/olmoe3_$tag.json 2>&1 \
    | grep -v Warning | tail -4
  mark tt_olmoe3
  tt olmoe3-4l-8e after 30
  if [ -n "$s1" ] && [ -z "${SKIP_S1:-}" ]; then
    mark olmoe8l
    timeout 120 python3 tools/bench_train.py $S1 --steps 12 --warmup 4 $s1 --json $OUT/olmoe8l_$tag.json 2>&1 \
      | grep -v Warning | tail -4
    mark tt_olmoe8l
    tt olmoe-1b-7b-8l after 25
  fi
  mark end
  kill $dmon
  echo "runs $(( $(date +%s) - t0 )) s"
  python3 tools/clocks.py dmon $OUT/dmon.txt $OUT/marks.txt
  python3 tools/peer_ratio.py $OUT/olmoe3_$tag.json --peer $OUT/torchtitan_olmoe3-4l-8e_after.jsonl 2>&1 | tail -4
  [ ! -f $OUT/olmoe8l_$tag.json ] || python3 tools/peer_ratio.py $OUT/olmoe8l_$tag.json \
    --peer $OUT/torchtitan_olmoe-1b-7b-8l_after.jsonl 2>&1 | tail -4
}
