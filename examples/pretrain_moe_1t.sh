#!/usr/bin/env bash
# moetron's headline recipe: a 1.2T-parameter MoE (OLMo-core 3 "Ultra-128E": 63 layers x 6144,
# 128 routed experts + 1 shared, top-4, EP 8 x PP 8 on 512 GPUs).
#
# On a machine without that many GPUs it runs a local proxy end to end: set-up (a venv on first
# use), the embedded corpus (built on first use), training, a checkpoint half-way, a new process
# that resumes from it, a summary of the loss and of the expert load, and plots of both
# (tools/plot.py: PNGs under RUN_DIR/plots). The proxy is sized to
# the machine (PROXY=auto picks gpu when NPROC GPUs are visible and --trainer.device=cpu is not given):
#   cpu: recipe tiny-moe-local (preset tiny-moe), moe-1t's block design at CPU size (top-4 over 16
#        experts + 1 shared, first layer dense, Olmo 3 attention with sliding windows), a few minutes on 2 cores;
#   gpu: recipe moe-1t-proxy (its preset), moe-1t's routing as is (top-4 over 128 experts + 1 shared, the
#        Switch loss plus the expert bias, the first two layers dense, expert hidden 4/3 of d_model) at d_model 768, with 2 + 2 x NPROC
#        layers, expert parallel over all NPROC GPUs (ep = NPROC), 16K tokens per GPU per step.
#
#   bash examples/pretrain_moe_1t.sh                      # local proxy
#   STEPS=400 bash examples/pretrain_moe_1t.sh --optimizer.lr=2e-3   # extra args: config overrides
#   NPROC=4 bash examples/pretrain_moe_1t.sh              # 4 ranks via torchrun (NCCL on GPUs, gloo on CPU)
#   NPROC=2 PROXY=cpu bash examples/pretrain_moe_1t.sh --parallel.ep=2 --trainer.device=cpu
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 NPROC=8 bash examples/pretrain_moe_1t.sh   # on each node
#   sbatch examples/slurm/pretrain_moe_1t.sbatch                                     # SLURM (srun)
#   PRINT_LAUNCH=1 bash examples/pretrain_moe_1t.sh     # print this node's launch commands only
#   bash examples/pretrain_moe_1t.sh --dry-run          # the full recipe's plan (GPU=b300 NUM_GPUS=512) + launch
#   PROXY=full ... bash examples/pretrain_moe_1t.sh --data.train_paths=[...]   # the real recipe (one phase)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="$(bash tools/setup_env.sh)"

if [ "${1:-}" = "--dry-run" ]; then
  # The plan of the full recipe on a cluster (GPU type and count), and the exact launch: nothing trains.
  shift
  GPU="${GPU:-b300}"; NUM_GPUS="${NUM_GPUS:-512}"; GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
  echo "== dry run: recipe moe-1t on $NUM_GPUS x $GPU ($((NUM_GPUS / GPUS_PER_NODE)) nodes x $GPUS_PER_NODE), planned, not run"
  "$py" tools/plan.py --preset moe-1t --gpu "$GPU" --num-gpus "$NUM_GPUS" --parallel.ep=8 --parallel.pp=8 --parallel.pp_microbatches=128 \
    --seq-len 8192 --global-batch 8192 --micro-batch 1 --memory.recompute=full --json "" "$@"
  echo "== launch: sbatch --nodes=$((NUM_GPUS / GPUS_PER_NODE)) examples/slurm/pretrain_moe_1t.sbatch --data.train_paths=[...]"
  echo "   with PROXY=full in its environment; each node then runs:"
  PRINT_LAUNCH=1 PROXY=full NNODES=$((NUM_GPUS / GPUS_PER_NODE)) NODE_RANK='$SLURM_NODEID' MASTER_ADDR='$MASTER_ADDR' \
    NPROC="$GPUS_PER_NODE" RUN_DIR="${RUN_DIR:-runs/pretrain_moe_1t-cluster}" MOETRON_PYTHON="$py" bash "$0" \
    | tail -n 1 | sed 's/^/   /'
  exit 0
fi
STEPS="${STEPS:-240}"
NPROC="${NPROC:-1}"
RUN_DIR="${RUN_DIR:-}"  # default below, once the launch mode is known
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
  cpu) model=(--recipe tiny-moe-local) ;;  # recipes: moetron.run.recipes (docs/training.md)
  gpu) model=(--recipe moe-1t-proxy --model.n_layers=$((2 + 2 * NPROC)) --parallel.ep="$NPROC"
              --data.global_batch_size=$((8 * NPROC))) ;;  # the recipe is for 8 GPUs: resized to NPROC
  full) model=(--recipe moe-1t) ;;  # the real 1.2T recipe (512 GPUs; give --data.train_paths)
  *) echo "error: PROXY=$PROXY: choose auto, cpu, gpu or full" >&2; exit 2 ;;
esac

# How to launch, said at start with the reason:
#   SLURM (SLURM_JOB_ID and SLURM_NNODES set, e.g. under srun from examples/slurm/): one torchrun per
#     node, the node count, node rank and rendezvous host from SLURM (MASTER_ADDR: the first node of
#     SLURM_JOB_NODELIST unless set);
#   NNODES > 1 (set by hand): one torchrun per node with NODE_RANK, MASTER_ADDR and MASTER_PORT;
#   NPROC > 1 on one machine: torchrun --standalone; else one plain process.
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_PORT="${MASTER_PORT:-29500}"
if [ -n "${SLURM_JOB_ID:-}" ] && [ -n "${SLURM_NNODES:-}" ]; then
  NNODES="$SLURM_NNODES"; NODE_RANK="${SLURM_NODEID:-0}"
  if [ -z "${MASTER_ADDR:-}" ]; then
    MASTER_ADDR="$( (scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null || true) | head -n 1)"
    MASTER_ADDR="${MASTER_ADDR:-${SLURM_JOB_NODELIST%%,*}}"
  fi
  mode="slurm: $NNODES node(s) x $NPROC rank(s), this is node $NODE_RANK (SLURM_NNODES, SLURM_NODEID), rendezvous $MASTER_ADDR:$MASTER_PORT"
elif [ "$NNODES" -gt 1 ]; then
  if [ -z "${MASTER_ADDR:-}" ]; then echo "error: NNODES=$NNODES needs MASTER_ADDR (the host of node 0) and NODE_RANK" >&2; exit 2; fi
  mode="multi-node: $NNODES node(s) x $NPROC rank(s), this is node $NODE_RANK (NNODES, NODE_RANK), rendezvous $MASTER_ADDR:$MASTER_PORT"
elif [ "$NPROC" -gt 1 ]; then
  mode="one machine: $NPROC ranks (NPROC) under torchrun --standalone"
else
  mode="one process (set NPROC, NNODES or run under SLURM for more)"
fi
if [ -z "$RUN_DIR" ]; then  # every node must name the same run dir (on a file system they all see)
  if [ -n "${SLURM_JOB_ID:-}" ]; then RUN_DIR="runs/pretrain_moe_1t-slurm-$SLURM_JOB_ID"
  elif [ "$NNODES" -gt 1 ]; then echo "error: NNODES=$NNODES needs RUN_DIR: the same path on every node, on a file system they all see" >&2; exit 2
  else RUN_DIR="runs/pretrain_moe_1t_local-$(date +%Y%m%d-%H%M%S)"; fi
fi
if [ "$NNODES" -gt 1 ]; then
  # c10d rendezvous; the run id keeps the two phases' rendezvous apart
  launch_for() { echo "$py" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --nproc-per-node "$NPROC" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$1"; }
elif [ "$NPROC" -gt 1 ]; then
  launch_for() { echo "$py" -m torch.distributed.run --standalone --nproc-per-node "$NPROC"; }
else
  launch_for() { echo "$py"; }
fi
run_id="$(basename "$RUN_DIR")"
read -r -a launch <<< "$(launch_for "$run_id-1")"
read -r -a relaunch <<< "$(launch_for "$run_id-2")"
common=("${model[@]}" --name=moe-1t-proxy --trainer.run_dir="$RUN_DIR" --trainer.steps="$STEPS"
        --trainer.eval_interval=$((STEPS / 4)) --scheduler.warmup_steps="$warmup")

echo "== launch: $mode"
if [ "$PROXY" = full ]; then
  # The real recipe keeps its own schedule; one phase, resuming whenever the run dir holds a checkpoint
  # (re-submit the same job after a failure).
  full=("${launch[@]}" tools/pretrain.py "${model[@]}" --trainer.run_dir="$RUN_DIR" "$@")
  [ -d "$RUN_DIR/checkpoints" ] && full+=(--resume)
  if [ -n "${PRINT_LAUNCH:-}" ]; then echo "== recipe: moe-1t"; echo "${full[*]}"; exit 0; fi
  exec "${full[@]}"
fi
echo "== proxy: $PROXY (${model[*]}), $NPROC rank(s) per node"
if [ -n "${PRINT_LAUNCH:-}" ]; then  # print the two commands this node would run, run nothing
  echo "${launch[*]} tools/pretrain.py ${common[*]} --trainer.stop_at_step=$half $*"
  echo "${relaunch[*]} tools/pretrain.py --config $RUN_DIR/config.yaml --trainer.stop_at_step=null --resume"
  exit 0
fi
echo "== phase 1: train steps 1..$half of $STEPS, then checkpoint and stop (run dir $RUN_DIR)"
"${launch[@]}" tools/pretrain.py "${common[@]}" --trainer.stop_at_step="$half" "$@"
echo "== phase 2: a new process resumes from the checkpoint and trains to step $STEPS"
"${relaunch[@]}" tools/pretrain.py --config "$RUN_DIR/config.yaml" --trainer.stop_at_step=null --resume
if [ "$NODE_RANK" != 0 ]; then exit 0; fi  # node 0 (global rank 0) wrote the logs: it summarizes and plots

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
