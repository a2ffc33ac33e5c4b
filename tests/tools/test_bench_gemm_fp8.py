"""tools/bench_gemm_fp8.py --tiny on the CPU (Triton interpreted): the correctness check passes, the
table and the JSON have a row for every backend it ran, of both kinds."""

import json
import os
import sys

import pytest

from tests.interpreted import skip_unless_interpreter_works
from tests.processes import run_python

pytestmark = pytest.mark.slow  # among the longest modules: run first (tests/conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Left out of the timed rows (--backends): on the CPU each runs only code that the rows kept run
# too, at 12 and 8 of the full run's 44 interpreted GEMM launches. gluon: the Triton kernels off
# SM90 (its correctness checks still run and are asserted); fp8_blockwise bf16-wgrad: fp8_blockwise's
# forward and dgrad kernels, the bf16-wgrad branch that the cublas bf16-wgrad row takes and the bf16
# row's torch._grouped_mm weight gradients; fp8_blockwise gluon bf16-wgrad: the two of them together.
SKIPPED = ("fp8_blockwise gluon", "fp8_blockwise bf16-wgrad", "fp8_blockwise gluon bf16-wgrad")
GROUPED = {("bf16", "cached"), ("bf16 cublas", "cached"), ("fp8_blockwise", "cached"), ("fp8_blockwise", "requantized"),
           ("fp8_blockwise cublas", "cached"), ("fp8_blockwise cublas", "requantized"),
           ("fp8_blockwise gluon", "cached"), ("fp8_blockwise gluon", "requantized"),
           ("fp8_blockwise bf16-wgrad", "cached"), ("fp8_blockwise bf16-wgrad", "requantized"),
           ("fp8_blockwise cublas bf16-wgrad", "cached"), ("fp8_blockwise cublas bf16-wgrad", "requantized"),
           ("fp8_blockwise gluon bf16-wgrad", "cached"), ("fp8_blockwise gluon bf16-wgrad", "requantized"),
           ("mxfp8 emulated", "cached"), ("mxfp8 emulated", "requantized"),
           ("fp8_rowwise", "cached"), ("fp8_rowwise", "requantized"),
           ("fp8_rowwise fast", "cached"), ("fp8_rowwise fast", "requantized"),
           ("fp8_rowwise bf16-wgrad", "cached"), ("fp8_rowwise bf16-wgrad", "requantized")}


def test_tiny_run_checks_and_reports(tmp_path):
    """Every check (the grouped GEMMs through the triton, cublas and gluon experts, the dense Triton
    linear) passes; a grouped row for every backend but SKIPPED's, the cached weights mode (the CPU's); the dense bf16
    and fp8_blockwise triton rows. GROUPED is the tool's whole list (on a GPU), SKIPPED's included."""
    skip_unless_interpreter_works()
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import bench_gemm_fp8
    import torch

    assert set(bench_gemm_fp8.backends(torch.device("cpu"))) == {b for b, _ in GROUPED}
    out = tmp_path / "gemm.json"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    ran = sorted({b for b, _ in GROUPED} - set(SKIPPED)) + ["fp8_blockwise triton"]  # the last: the dense row
    proc = run_python([os.path.join(ROOT, "tools", "bench_gemm_fp8.py"), "--tiny", "--backends", *ran,
                       "--json", str(out)], timeout=900, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    checks = [r for r in rows if r["kind"] == "check"]
    assert checks and all(r["ok"] for r in checks)
    grouped = {(r["backend"], r["weights"]) for r in rows if r["kind"] == "grouped"}
    # one untimed call on the CPU: the cached rows only (a requantized row would do the same work)
    assert grouped == {(b, w) for b, w in GROUPED if b not in SKIPPED and w == "cached"}
    passes = ("fwd", "dgrad", "wgrad")
    assert {r["check"] for r in checks} >= ({f"grouped {k} {p}" for k in ("triton", "cublas", "gluon") for p in passes}
                                            | {f"dense triton {p}" for p in passes})
    assert {r["backend"] for r in rows if r["kind"] == "dense"} == {"bf16", "fp8_blockwise triton"}
    assert "MISMATCH" not in proc.stdout
    assert not [r for r in rows if r["kind"] == "profile"]  # --profile's rows: test_backends_and_shapes_pick_rows


def test_phases_name_the_kernels():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import bench_gemm_fp8

    assert bench_gemm_fp8.phase_of("_fp8_grouped_gemm_rows_kernel") == "gemm"
    assert bench_gemm_fp8.phase_of("_fp8_quantize_1x128_kernel") == "quantize"
    assert bench_gemm_fp8.phase_of("_mx_quantize_kernel") == "quantize"
    assert bench_gemm_fp8.phase_of("void at::native::reduce_kernel<512, 1, ...>") == "quantize"
    assert bench_gemm_fp8.phase_of("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert bench_gemm_fp8.phase_of("searchsorted_cuda_kernel") == "other"
    assert bench_gemm_fp8.phase_of("_gluon_rows_kernel") == "gemm"  # session 36 call 3 counted them "other"
    assert bench_gemm_fp8.phase_of("_gluon_k_kernel") == "gemm"
    # the row-tile table with its GEMM, as tools/profile_step.py counts it (one classification for both tools)
    assert bench_gemm_fp8.phase_of("_gluon_tile_table_kernel") == "gemm"


def test_backends_and_shapes_pick_rows(tmp_path):
    """--backends keeps bf16 and the named backends only (their grouped and --profile rows; --loop
    recorded in the grouped rows); --shapes and --backends refuse an unknown name."""
    skip_unless_interpreter_works()
    out = tmp_path / "gemm.json"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    cmd = [os.path.join(ROOT, "tools", "bench_gemm_fp8.py"), "--tiny", "--skip-check", "--no-dense",
           "--backends", "fp8_blockwise cublas bf16-wgrad", "--profile", "--loop", "2", "--json", str(out)]
    proc = run_python(cmd, timeout=900, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    backends = {"bf16", "fp8_blockwise cublas bf16-wgrad"}
    assert {(r["kind"], r["backend"]) for r in rows} == {(kind, b) for kind in ("grouped", "profile") for b in backends}
    assert all(r["loop"] == 2 for r in rows if r["kind"] == "grouped")
    # --profile: each backend's step split into quantize, GEMM and other kernel time, with its top kernels
    for r in (r for r in rows if r["kind"] == "profile"):
        assert abs(r["quantize_ms"] + r["gemm_ms"] + r["other_ms"] - r["ms"]) < 1e-6 * max(1.0, r["ms"]) and r["top"]
    bad = run_python([os.path.join(ROOT, "tools", "bench_gemm_fp8.py"), "--shapes", "olmo"],
                     timeout=300, cwd=ROOT, env=env)
    assert bad.returncode == 2 and "unknown --shapes ['olmo']" in bad.stderr
    bad = run_python([os.path.join(ROOT, "tools", "bench_gemm_fp8.py"), "--tiny", "--backends", "fp8_blockwse"],
                     timeout=300, cwd=ROOT, env=env)
    assert bad.returncode == 2 and "unknown --backends ['fp8_blockwse'] on cpu" in bad.stderr, bad.stderr
    assert "'fp8_blockwise cublas bf16-wgrad'" in bad.stderr and "'fp8_blockwise triton'" in bad.stderr
