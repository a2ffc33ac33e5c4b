"""tools/bench_gemm_fp8.py --tiny on the CPU (Triton interpreted): the correctness check passes, the
table and the JSON have every backend of both kinds."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tiny_run_checks_and_reports(tmp_path):
    out = tmp_path / "gemm.json"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_gemm_fp8.py"), "--tiny", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    checks = [r for r in rows if r["kind"] == "check"]
    assert checks and all(r["ok"] for r in checks)
    grouped = {(r["backend"], r["weights"]) for r in rows if r["kind"] == "grouped"}
    assert grouped == {("bf16", "cached"), ("fp8_blockwise", "cached"), ("fp8_blockwise", "requantized"),
                       ("mxfp8 emulated", "cached"), ("mxfp8 emulated", "requantized")}
    assert {r["backend"] for r in rows if r["kind"] == "dense"} >= {"bf16", "fp8_blockwise triton"}
    assert "MISMATCH" not in proc.stdout
