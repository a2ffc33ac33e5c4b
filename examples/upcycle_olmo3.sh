#!/usr/bin/env bash
# Sparse upcycling of a dense Olmo 3 into an MoE, end to end (docs/upcycling.md):
#   (a) a dense checkpoint: DENSE (an HF directory or a native checkpoint) if given, else a tiny
#       dense Olmo 3 trained here for a few steps on the embedded corpus (CPU);
#   (b) upcycle it: 8 experts, top-2, softmax with renormalization, no shared expert;
#   (c) score dense and upcycled on the held-out corpus: equal at step 0;
#   (d) continue pre-training the MoE from the upcycled weights (the pretrain.yaml upcycle.py writes);
#   (e) summary: the held-out loss of the dense, upcycled and trained MoE.
#
#   bash examples/upcycle_olmo3.sh                            # a few minutes on 2 CPU cores
#   DENSE=hf/Olmo-3-7B SCORE_DATA=data/val.bin bash examples/upcycle_olmo3.sh   # your model + data
#   EXPERTS=16 TOP_K=4 GRANULARITY=2 bash examples/upcycle_olmo3.sh --optimizer.lr=1e-3
# Extra arguments are config overrides for the MoE training run (d). SCORE_DATA must be tokenized
# with the dense model's tokenizer (the default is the embedded corpus's held-out split).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="$(bash tools/setup_env.sh)"

RUN_DIR="${RUN_DIR:-runs/upcycle_olmo3-$(date +%Y%m%d-%H%M%S)}"
DENSE_STEPS="${DENSE_STEPS:-60}"
MOE_STEPS="${MOE_STEPS:-40}"
EXPERTS="${EXPERTS:-8}"
TOP_K="${TOP_K:-2}"
GRANULARITY="${GRANULARITY:-1}"
SEQ_LEN="${SEQ_LEN:-128}"
SCORE_TOKENS="${SCORE_TOKENS:-16384}"
export MOETRON_DATA_DIR="${MOETRON_DATA_DIR:-$root/data_cache}"
train=(--trainer.device=cpu --precision.recipe=fp32 --data.seq_len="$SEQ_LEN" --data.global_batch_size=8
       --trainer.eval_interval=0 --trainer.log_interval=10)
mkdir -p "$RUN_DIR"

if [ -n "${DENSE:-}" ]; then
  echo "== (a) dense checkpoint: $DENSE"
  dense="$DENSE"
else
  echo "== (a) no DENSE given: train a tiny dense Olmo 3 for $DENSE_STEPS steps on the embedded corpus"
  "$py" tools/pretrain.py --preset tiny --name=dense-tiny --trainer.run_dir="$RUN_DIR/dense" \
    --trainer.steps="$DENSE_STEPS" --scheduler.warmup_steps=$((DENSE_STEPS / 10)) "${train[@]}"
  dense="$(ls -d "$RUN_DIR"/dense/checkpoints/step_* | tail -n 1)"
fi

echo "== (b) upcycle: $EXPERTS experts, top-$TOP_K, granularity $GRANULARITY, softmax + renormalize"
"$py" tools/upcycle.py "$dense" --output "$RUN_DIR/upcycled" --num-experts "$EXPERTS" --top-k "$TOP_K" \
  --granularity "$GRANULARITY" --score softmax --seed 0

if [ -z "${SCORE_DATA:-}" ]; then
  SCORE_DATA="$("$py" -c "import sys; from moetron.data.corpus import ensure_default_corpus
print(ensure_default_corpus(sys.argv[1], 4096)['val'])" "$MOETRON_DATA_DIR")"
fi
score() {  # score CKPT NAME -> prints the summary, keeps the per-token log-probs
  "$py" tools/score.py "$1" "$SCORE_DATA" --seq-len "$SEQ_LEN" --batch-size 8 --max-tokens "$SCORE_TOKENS" \
    --output "$RUN_DIR/logprobs_$2.npy" | tee "$RUN_DIR/score_$2.txt"
}
echo "== (c) score the dense and the upcycled model on $SCORE_DATA (they must agree at step 0)"
score "$dense" dense
score "$RUN_DIR/upcycled" upcycled

echo "== (d) continue pre-training the MoE for $MOE_STEPS steps from the upcycled weights"
"$py" tools/pretrain.py --config "$RUN_DIR/upcycled/pretrain.yaml" --trainer.run_dir="$RUN_DIR/moe" \
  --trainer.steps="$MOE_STEPS" --scheduler.warmup_steps=$((MOE_STEPS / 10)) "${train[@]}" "$@"
score "$RUN_DIR/moe/checkpoints" moe

echo "== (e) summary"
"$py" - "$RUN_DIR" <<'PY'
import re, sys
import numpy as np
run = sys.argv[1]
loss = {n: float(re.search(r"mean loss: (\S+)", open(f"{run}/score_{n}.txt").read())[1]) for n in ("dense", "upcycled", "moe")}
dense, up = np.load(f"{run}/logprobs_dense.npy"), np.load(f"{run}/logprobs_upcycled.npy")
print(f"held-out loss: dense {loss['dense']:.4f} | upcycled at step 0 {loss['upcycled']:.4f} "
      f"(max per-token |diff| {np.abs(dense - up).max():.2e}) | MoE after training {loss['moe']:.4f}")
print(open(f"{run}/score_moe.txt").readline().strip())
if np.abs(dense - up).max() > 1e-3:
    sys.exit("the upcycled model does not start at the dense model")
PY
