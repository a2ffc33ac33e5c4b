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
