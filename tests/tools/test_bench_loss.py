"""tools/bench_loss.py on the CPU at tiny sizes: every row is measured and written, the fused loss
is as close to the float64 truth as the plain one, bad sizes fail with one error."""

import json

import pytest

import bench_loss
from moetron.core.config import ConfigError


def test_rows_and_errors(tmp_path, capsys):
    out = tmp_path / "loss.json"
    bench_loss.main(["--tokens", "200", "--vocab", "300", "--d-model", "32,48", "--chunk-tokens", "64,500",
                     "--steps", "1", "--warmup", "0", "--device", "cpu", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["d_model"], r["variant"], r["chunk_tokens"]) for r in rows] == [
        (d, v, c) for d in (32, 48) for v, c in (("plain", None), ("fused", 64), ("fused", 500))]
    for r in rows:
        assert r["fwd_bwd_ms"] > 0 and r["peak_gib"] is None  # no CUDA: no memory columns
        assert r["loss_rel_err"] < 1e-5 and r["grad_h_rel_err"] < 2e-2 and r["grad_w_rel_err"] < 2e-2
    assert "fused" in capsys.readouterr().out


def test_gemms_rows(tmp_path, capsys):
    """--gemms: every layout of each GEMM gets a row (n/a where the device has no such kernel); the
    three the loss runs (through its own _mm_into, which falls back where needed) are timed."""
    out = tmp_path / "gemms.json"
    bench_loss.main(["--gemms", "--vocab", "96", "--d-model", "32", "--chunk-tokens", "64", "--steps", "1",
                     "--warmup", "1", "--device", "cpu", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["gemm"] for r in rows] == ["logits"] * 2 + ["grad_h"] * 2 + ["grad_W"] * 4
    used = [r for r in rows if r["layout"].startswith("used")]
    assert len(used) == 3 and all(r["ms"] > 0 and r["tflops"] > 0 for r in used)
    assert "grad_W" in capsys.readouterr().out


def test_rows_sweep(tmp_path):
    """--rows: a row per setting (block x warps x the gradient pass's direction), each timed, the
    module's default marked only where it was swept; on the CPU it needs TRITON_INTERPRET=1 (the
    tool run in a process of its own with it)."""
    import os

    from tests.interpreted import skip_unless_interpreter_works
    from tests.processes import run_python
    from tests.reporting import ROOT

    skip_unless_interpreter_works()
    out = tmp_path / "rows.json"
    proc = run_python([os.path.join(ROOT, "tools", "bench_loss.py"), "--rows", "--vocab", "300", "--chunk-tokens", "4",
                       "--row-blocks", "128,512", "--row-warps", "4", "--steps", "1", "--warmup", "1", "--device", "cpu",
                       "--json", str(out)], env=dict(os.environ, TRITON_INTERPRET="1"), timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "backward" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["block"], r["num_warps"], r["reversed"]) for r in rows] == [
        (b, 4, rev) for b in (128, 512) for rev in (False, True)]
    assert all(r["ms"] > 0 and r["gbps"] > 0 and not r["default"] for r in rows)  # the default (4096, 8) not swept
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        bench_loss.main(["--rows", "--device", "cpu", "--vocab", "64", "--chunk-tokens", "4"])


def test_bad_sizes():
    with pytest.raises(SystemExit):
        bench_loss.main(["--d-model", "0"])
    with pytest.raises(ConfigError, match="--tokens"):
        bench_loss.main(["--tokens", "0", "--device", "cpu"])
