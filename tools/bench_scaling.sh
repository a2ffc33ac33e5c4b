#!/usr/bin/env bash
# The multi-GPU measurement matrix of docs/performance.md, in one call on one host:
#
#   bash tools/bench_scaling.sh OUT_DIR [GPUS] [PART ...]
#
# PARTs (default: all of them, in this order):
#   comm      the interconnect: tools/bench_comm.py on all GPUs, plus nvidia-smi topo -m
#   equiv     the parallel equivalence tests with NCCL (layouts that fit the GPUs)
#   ep        expert-parallel weak scaling, 16K tokens per GPU: OLMoE-1B-7B (8 of 16 layers) and
#             olmo3-moe-64e (2 of 8 layers) at ep = 1, 2, 4, ... GPUS, each dispatch (synced,
#             sync_free, all_gather); with 8 GPUs also ep=4 x dp_shard=2
#   pipe      pipeline pp = 2 and 4 (GPipe, 1F1B, interleaved 1F1B) on OLMoE (8 layers, 16 x 4096
#             tokens, 8 micro-batches) against the whole model on one GPU (measured bubble vs theory)
#   example   examples/pretrain_moe_1t.sh on all GPUs (the proxy sized to the machine)
#
# A device call runs at most 10 minutes: on 4-8 GPUs run the parts in separate calls (comm equiv;
# ep; pipe example), each into the same OUT_DIR on a disk that outlives the call, or copy back each
# call's summary.txt and all.json. Every JSON, log and table lands in OUT_DIR; OUT_DIR/summary.txt holds the tables and
# OUT_DIR/all.json every benchmark row, so two files carry everything back. NVLink multicast
# stays off. Each run is bounded by `timeout`; a failed one is noted and the rest go on.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${1:?usage: bash tools/bench_scaling.sh OUT_DIR [GPUS] [PART ...]}"
shift
gpus="${1:-}"
if [[ "$gpus" =~ ^[0-9]+$ ]]; then shift; else gpus="$(nvidia-smi -L 2>/dev/null | wc -l)"; fi
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(comm equiv ep pipe example)
[ "$gpus" -ge 1 ] || { echo "error: no GPUs visible (nvidia-smi -L); pass GPUS" >&2; exit 2; }
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" MOETRON_DATA_DIR="${MOETRON_DATA_DIR:-/tmp/moetron_data}"
py="${MOETRON_PYTHON:-python3}"
summary="$out/summary.txt"
echo "bench_scaling: $gpus GPU(s), parts: ${parts[*]}, $(date -u '+%Y-%m-%d %H:%M UTC')" | tee "$summary"

run() {  # run NAME SECONDS NPROC SCRIPT ARGS...: torchrun, log to OUT_DIR/NAME.log, tables to the summary
  local name="$1" secs="$2" nproc="$3"; shift 3
  local devices; devices="$(seq -s, 0 $((nproc - 1)))"
  echo "== $name: CUDA_VISIBLE_DEVICES=$devices torchrun --nproc-per-node $nproc $*" | tee -a "$summary"
  CUDA_VISIBLE_DEVICES="$devices" timeout "$secs" "$py" -m torch.distributed.run --standalone \
    --nproc-per-node "$nproc" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || echo "   FAILED (exit $rc): see $name.log" | tee -a "$summary"
  # the printed table: from the header line to the end, without the ranks' warnings
  grep -v '^\[rank\|Warning\|warn(' "$out/$name.log" | sed -n '/ x [0-9]* |/,$p' | grep -v '^wrote ' >> "$summary"
}

has() { [[ " ${parts[*]} " == *" $1 "* ]]; }
sizes=()
for n in 1 2 4 8 16; do [ "$n" -le "$gpus" ] && sizes+=("$n"); done

if has comm; then
  nvidia-smi topo -m > "$out/topology.txt" 2>&1; cat "$out/topology.txt" >> "$summary"
  [ "$gpus" -gt 1 ] && run comm 300 "$gpus" tools/bench_comm.py --json "$out/comm.json"
fi

if has equiv && [ "$gpus" -gt 1 ]; then
  echo "== equivalence tests with NCCL" | tee -a "$summary"
  timeout 900 "$py" -m pytest -q -m multigpu tests/parallel/test_equivalence.py -p no:cacheprovider \
    > "$out/equiv.log" 2>&1
  tail -3 "$out/equiv.log" >> "$summary"
fi

if has ep; then
  variants=(synced:parallel.ep_dispatch=synced sync_free:parallel.ep_dispatch=sync_free
            all_gather:parallel.ep_dispatch=all_gather)
  for model in "olmoe-1b-7b --model.n_layers=8" "olmo3-moe-64e --model.n_layers=2"; do
    tag="${model%% *}"
    common=(tools/bench_parallel.py --preset $model --tokens-per-gpu 16384 --seq-len 4096 --steps 10 --warmup 3)
    for n in "${sizes[@]}"; do
      if [ "$n" -eq 1 ]; then
        run "ep1_$tag" 240 1 "${common[@]}" --json "$out/ep1_$tag.json"
      else
        run "ep${n}_$tag" 400 "$n" "${common[@]}" --parallel.ep="$n" --json "$out/ep${n}_$tag.json" \
          --variants "${variants[@]}"
      fi
    done
    if [ "$gpus" -ge 8 ]; then
      run "ep4dp2_$tag" 400 8 "${common[@]}" --parallel.ep=4 --json "$out/ep4dp2_$tag.json" --variants "${variants[@]}"
    fi
  done
fi

if has pipe && [ "$gpus" -gt 1 ]; then
  pipe=(tools/bench_parallel.py --preset olmoe-1b-7b --model.n_layers=8 --seq-len 4096 --data.global_batch_size=16
        --steps 6 --warmup 2)
  run pipe_base1 300 1 "${pipe[@]}" --trainer.micro_batch_size=2 --json "$out/pipe_base1.json"
  for n in "${sizes[@]}"; do
    { [ "$n" -eq 1 ] || [ "$n" -gt 4 ]; } && continue  # 8 layers: interleaving needs 2 x pp of them
    p="parallel.pp=$n,parallel.dp_shard=1,parallel.pp_microbatches=8"
    run "pipe_pp$n" 500 "$n" "${pipe[@]}" --bubble-baseline "$out/pipe_base1.json:base" --json "$out/pipe_pp$n.json" \
      --variants "gpipe:$p,parallel.pp_schedule=gpipe" "1f1b:$p" \
      "interleaved:$p,parallel.pp_schedule=interleaved_1f1b,parallel.pp_stages_per_rank=2"
  done
fi

if has example; then
  echo "== NPROC=$gpus bash examples/pretrain_moe_1t.sh" | tee -a "$summary"
  start=$(date +%s)
  NPROC="$gpus" MOETRON_PYTHON="$py" RUN_DIR="${TMPDIR:-/tmp}/moetron_example_run" timeout 900 bash examples/pretrain_moe_1t.sh \
    > "$out/example.log" 2>&1
  echo "   exit $? after $(( $(date +%s) - start )) s" | tee -a "$summary"
  grep -v '^\[rank' "$out/example.log" | grep '^==\|^run \|^step .*0 |' >> "$summary"
fi

# Every benchmark row in one file (what comes back from a machine is a handful of files).
"$py" - "$out" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
merged = {}
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    if os.path.basename(path) != "all.json":
        try:
            merged[os.path.basename(path)] = json.load(open(path))
        except (OSError, ValueError) as e:
            merged[os.path.basename(path)] = {"error": str(e)}
json.dump(merged, open(os.path.join(out, "all.json"), "w"), indent=1)
print(f"wrote {os.path.join(out, 'all.json')} ({len(merged)} benchmark files)")
PY
echo "summary: $summary"
