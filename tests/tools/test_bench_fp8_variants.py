"""tools/bench_fp8_variants.py --tiny on the CPU (Triton interpreted): every pass's row has the three
timings (bf16, masked, pipelined), the pipelined kernel's config and its agreement with the masked kernel.

The down GEMM only (I = F = 128, O = D = 256 at the tiny shape): its passes cover the kernels' one-
and two-K-block and one- and two-N-tile cases (forward: K = 128 into two 128-column tiles; dgrad:
K = 256 into one), in about half the interpreter time of gate|up (I = O = 256), which the tool runs
through the same code; both kernels are checked on more shapes in tests/core/test_precision_fp8.py."""

import json
import os

from tests.interpreted import skip_unless_interpreter_works
from tests.processes import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tiny_run_compares_the_kernels(tmp_path):
    skip_unless_interpreter_works()
    out = tmp_path / "variants.json"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    proc = run_python([os.path.join(ROOT, "tools", "bench_fp8_variants.py"), "--tiny",
                       "--gemms", "down", "--json", str(out)],
                      timeout=900, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["gemm"], r["pass"], r["I"], r["O"]) for r in rows] == [("down", p, 128, 256)
                                                                      for p in ("fwd", "dgrad", "wgrad")]
    for r in rows:
        assert r["ok"] and r["rel_diff"] <= 2 ** -7
        assert all(r[f"{k}_ms"] > 0 for k in ("bf16", "masked", "pipelined")) and r["config"].startswith("BM")
    assert "MISMATCH" not in proc.stdout
