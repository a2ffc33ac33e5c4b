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


def test_bad_sizes():
    with pytest.raises(SystemExit):
        bench_loss.main(["--d-model", "0"])
    with pytest.raises(ConfigError, match="--tokens"):
        bench_loss.main(["--tokens", "0", "--device", "cpu"])
