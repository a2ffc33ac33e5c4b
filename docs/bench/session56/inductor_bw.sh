#!/usr/bin/env bash
# Queued by session 56: how far from HBM's rate is each kernel inductor generates in #13's step? The profiles give
# each kernel's time, not its bytes; inductor counts the bytes of its own kernels (kernel_num_gb) and, with
# TORCHINDUCTOR_PROFILE=1, times each one alone and writes ms, GB and GB/s per kernel to
# TORCHINDUCTOR_PROFILE_OUTPUT at the end of each compiled graph's call. Inductor's pointwise and norm kernels are
# 5-10 ms of OLMoE-8L's step beside the 1.4-2.2 GB/layer their floors would move; this says which of them sit
# below the rate and by how much (time above floor = ms - GB / the card's measured ~4.3 TB/s (H200) or ~3.0 (H100)).
# The step's results are not trusted under it (inductor re-runs each kernel to time it), only the table.
# Run from the repo root: bash docs/bench/session56/inductor_bw.sh (timeout 600; about 300 s: two fresh compiles);
# SHAPES=S1 for OLMoE-8L alone.
source docs/bench/session42/common.sh
O=$(flags "$BEST,$SHE")
# Torch 2.11's inductor, with a profile output set, runs each compiled module's benchmark harness at compile time
# without its arguments (TypeError: benchmark_compiled_module() missing 'args'; session 57's call 1); torch 2.13
# passes them. The harness is not needed for the table (each graph's call writes it), so it is turned off.
HARNESS_OFF='import os, runpy, sys; import torch._inductor.config as c; c.benchmark_harness = False
sys.argv = sys.argv[1:]; sys.path.insert(0, os.path.dirname(sys.argv[0])); runpy.run_path(sys.argv[0], run_name="__main__")'
for shape in ${SHAPES:-S1 S2}; do
  TORCHINDUCTOR_PROFILE=1 TORCHINDUCTOR_PROFILE_OUTPUT=$OUT/inductor_bw_$shape.txt TORCHINDUCTOR_FX_GRAPH_CACHE=0 \
    timeout 250 python3 -c "$HARNESS_OFF" tools/bench_train.py ${!shape} $O --steps 3 --warmup 2 \
    --json $OUT/inductor_bw_$shape.json 2>&1 | grep -v Warning | tail -1
  python3 - "$OUT/inductor_bw_$shape.txt" "$(nvidia-smi --query-gpu=name --format=csv,noheader)" <<'PY'
# The last step's calls (the file appends one block per compiled graph call): per kernel, its ms, GB, GB/s and time
# above HBM's floor, summed over the kernel's calls in that step, largest excess first.
import collections
import re
import sys

path, device = sys.argv[1], sys.argv[2]
rate = 4.3e12 if "H200" in device else 3.0e12  # measured HBM rates on these cards (docs/performance.md)
blocks = open(path).read().split("====================\n")[1:]
line = re.compile(r"^\s*([\d.]+)ms\s+([\d.]+) GB\s+([\d.]+)GB/s\s+([\d.]+)%\s+(\S+)")
# Kernel names repeat across graphs (each compiled module numbers its own): key them by module file too.
header = re.compile(r"TRITON KERNELS BANDWIDTH INFO \((.*)\)")
per_call = []
for b in blocks:
    module = header.search(b).group(1).rsplit("/", 1)[-1][:8] if header.search(b) else "?"
    per_call.append([(*m.groups()[:4], f"{module}:{m.group(5)}") for m in map(line.match, b.splitlines()) if m])
# A step calls the same graphs in the same order: take the last len/steps blocks as the last step (3 steps).
last = per_call[-(len(per_call) // 3):]
total = collections.defaultdict(lambda: [0.0, 0.0, 0])
for block in last:
    for ms, gb, _, _, name in block:
        t = total[name]
        t[0] += float(ms); t[1] += float(gb); t[2] += 1
rows = sorted(total.items(), key=lambda kv: kv[1][0] - kv[1][1] * 1e9 / rate * 1e3, reverse=True)
print(f"{device}: {len(last)} graph calls in the last step, {sum(v[0] for v in total.values()):.2f} ms of inductor "
      f"kernels timed alone, floor at {rate / 1e12:.1f} TB/s {sum(v[1] for v in total.values()) * 1e9 / rate * 1e3:.2f} ms")
print(f"{'ms':>7} {'GB':>7} {'TB/s':>6} {'above floor ms':>15} calls  kernel")
for name, (ms, gb, n) in rows[:25]:
    print(f"{ms:7.3f} {gb:7.3f} {gb / ms:6.2f} {ms - gb * 1e9 / rate * 1e3:15.3f} {n:5d}  {name[:90]}")
PY
done
