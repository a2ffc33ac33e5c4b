#!/usr/bin/env bash
# usage: conv.sh NAME:overrides... (overrides comma-separated); runs all concurrently, copies metrics to $OUT
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export MOETRON_PYTHON=$(command -v python3)
df -h / /dev/shm /tmp | sed 's/^/[df] /'
git log -1 --format='[code] %h %s' 2>/dev/null
# build the corpus once before the concurrent runs
python3 -c "from moetron.data.corpus import *" 2>/dev/null
mkdir -p /tmp/conv
pids=()
for spec in "$@"; do
  name="${spec%%:*}"; ov="${spec#*:}"; [ "$ov" = "$spec" ] && ov=""
  IFS=',' read -r -a args <<< "$ov"
  base=/tmp/conv; [[ " ${SHM_RUNS:-} " == *" $name "* ]] && base=/dev/shm/conv; mkdir -p $base
  ( STEPS=300 RUN_DIR=$base/$name bash examples/pretrain_moe_1t.sh --checkpoint.keep_last=1 "${args[@]}" > $OUT/$name.log 2>&1
    cp $base/$name/metrics.jsonl $OUT/$name.jsonl 2>/dev/null; rm -rf $base/$name/checkpoints
    echo "[done] $name rc=$? $(date +%T) $(grep '== summary' $OUT/$name.log)" ) &
  pids+=($!)
  sleep 2
done
wait
tar czf $OUT/logs.tgz -C $OUT $(cd $OUT; ls *.log) && rm -f $OUT/*.log
for spec in "$@"; do name="${spec%%:*}"; tar xzf $OUT/logs.tgz -O $name.log | grep -E "== summary|== expert load|error" | sed "s/^/[$name] /"; done
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
