#!/usr/bin/env bash
# moetron's headline recipe: a 1.2T-parameter MoE (OLMo-core 3 "Ultra-128E": 63 layers x 6144,
# 128 routed experts + 1 shared, top-4, EP 8 x PP 8 on 512 GPUs).
#
# On a machine without that many GPUs it runs a local proxy end to end: set-up (a venv on first
# use), the embedded corpus (built on first use), training, a checkpoint half-way, a new process
# that resumes from it, a summary of the loss and of the expert load, and plots of both
# (tools/plot.py: PNGs under RUN_DIR/plots). The proxy is sized to
# the machine (PROXY=auto picks gpu when NPROC GPUs are visible and --trainer.device=cpu is not given):
#   cpu: preset tiny-moe, the recipe's block design at CPU size (top-4 over 16 experts + 1 shared,
#        first layer dense, Olmo 3 attention with sliding windows), a few minutes on 2 cores;
#   gpu: preset moe-1t-proxy, the recipe's routing as is (top-4 over 128 experts + 1 shared, the
#        first two layers dense, expert hidden 4/3 of d_model) at d_model 768, with 2 + 2 x NPROC
#        layers, expert parallel over all NPROC GPUs (ep = NPROC), 16K tokens per GPU per step.
#
#   bash examples/pretrain_moe_1t.sh                      # local proxy
#   STEPS=400 bash examples/pretrain_moe_1t.sh --optimizer.lr=2e-3   # extra args: config overrides
#   NPROC=4 bash examples/pretrain_moe_1t.sh              # 4 ranks via torchrun (NCCL on GPUs, gloo on CPU)
#   NPROC=2 PROXY=cpu bash examples/pretrain_moe_1t.sh --parallel.ep=2 --trainer.device=cpu
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="$(bash tools/setup_env.sh)"

STEPS="${STEPS:-240}"
NPROC="${NPROC:-1}"
RUN_DIR="${RUN_DIR:-runs/pretrain_moe_1t_local-$(date +%Y%m%d-%H%M%S)}"
half=$((STEPS / 2))
if [ "$STEPS" -lt 2 ]; then echo "error: STEPS=$STEPS: the recipe trains, stops half-way and resumes: use STEPS >= 2" >&2; exit 2; fi
warmup=$((STEPS < 20 ? STEPS : 20))  # the default warmup (20 steps) may not exceed the run
PROXY="${PROXY:-auto}"
if [ "$PROXY" = auto ]; then
  gpus="$("$py" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
  PROXY=cpu
  if [ "$gpus" -ge "$NPROC" ] && [ "$gpus" -gt 0 ] && [[ " $* " != *" --trainer.device=cpu "* ]]; then PROXY=gpu; fi
fi
case "$PROXY" in
  cpu) model=(--preset tiny-moe) ;;
  gpu) model=(--preset moe-1t-proxy --model.n_layers=$((2 + 2 * NPROC)) --parallel.ep="$NPROC"
              --data.seq_len=2048 --data.global_batch_size=$((8 * NPROC))) ;;
  *) echo "error: PROXY=$PROXY: choose auto, cpu or gpu" >&2; exit 2 ;;
esac

if [ "$NPROC" -gt 1 ]; then
  launch=("$py" -m torch.distributed.run --standalone --nproc-per-node "$NPROC")
else
  launch=("$py")
fi
common=("${model[@]}" --name=moe-1t-proxy --trainer.run_dir="$RUN_DIR" --trainer.steps="$STEPS"
        --trainer.eval_interval=$((STEPS / 4)) --scheduler.warmup_steps="$warmup")

echo "== proxy: $PROXY (${model[*]}), $NPROC rank(s)"
echo "== phase 1: train steps 1..$half of $STEPS, then checkpoint and stop (run dir $RUN_DIR)"
"${launch[@]}" tools/pretrain.py "${common[@]}" --trainer.stop_at_step="$half" "$@"
echo "== phase 2: a new process resumes from the checkpoint and trains to step $STEPS"
"${launch[@]}" tools/pretrain.py --config "$RUN_DIR/config.yaml" --trainer.stop_at_step=null --resume

"$py" - "$RUN_DIR/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
train = [r for r in rows if r.get("loss") is not None]
evals = [r for r in rows if r.get("eval_loss") is not None]
print(f"== summary: train loss {train[0]['loss']:.3f} (step {train[0]['step']}) -> "
      f"{train[-1]['loss']:.3f} (step {train[-1]['step']}); held-out loss {evals[0]['eval_loss']:.3f} "
      f"(step {evals[0]['step']}) -> {evals[-1]['eval_loss']:.3f} (step {evals[-1]['step']})")
moe = [r for r in train if r.get("moe_max_violation") is not None]
if moe:
    print(f"== expert load: max violation (worst layer) {moe[0]['moe_max_violation']:.2f} -> "
          f"{moe[-1]['moe_max_violation']:.2f}; per-layer, per-expert counts in {sys.argv[1][:-len('metrics.jsonl')]}moe_load.npz")
PY
if "$py" -c "import matplotlib" 2>/dev/null; then
  echo "== plots (loss, lr, grad norm, throughput, every layer's expert load):"
  "$py" tools/plot.py "$RUN_DIR" | sed 's/^wrote /   /' || echo "== plotting failed (the training run is complete): $py tools/plot.py $RUN_DIR"
else
  echo "== plots: matplotlib is not installed; $py -m pip install matplotlib (or 'moetron[track]'), then $py tools/plot.py $RUN_DIR"
fi
