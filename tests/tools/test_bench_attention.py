"""tools/bench_attention.py on the CPU at its tiny size: the rows are measured and written, SDPA's
output and gradients agree with the naive float64 reference, and a wrong reference would show."""

import json

import pytest
import torch

import bench_attention


def test_tiny_rows(tmp_path, capsys):
    out = tmp_path / "attn.json"
    bench_attention.main(["--tiny", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["backend"], r["layout"]) for r in rows] == [("default", "strided"), ("default", "contiguous")]
    for r in rows:
        assert (r["heads"], r["kv_heads"], r["head_dim"]) == (4, 2, 16)
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0
        assert r["err_out"] < 1e-5 and r["err_grad"] < 1e-5  # float32 SDPA against the float64 loops
    assert "default" in capsys.readouterr().out


def test_naive_reference_is_causal_and_grouped():
    """The reference itself against a loop over positions and heads (causal, GQA)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 5, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    o = bench_attention.naive_attention(q, k, v)
    for h in range(4):
        for t in range(5):
            s = (k[0, h // 2, : t + 1] @ q[0, h, t]) / 8**0.5
            assert torch.allclose(o[0, h, t], torch.softmax(s, 0) @ v[0, h // 2, : t + 1])


def test_unknown_shape():
    with pytest.raises(SystemExit):
        bench_attention.main(["--shapes", "nope"])


def test_projection_rows(tmp_path):
    """--projections: split and fused q/k/v give a row each (eager on the CPU)."""
    out = tmp_path / "proj.json"
    bench_attention.main(["--tiny", "--projections", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["form"], r["compiled"]) for r in rows] == [("split", False), ("fused", False)]
    assert all(r["fwd_bwd_ms"] > 0 and (r["q_width"], r["kv_width"]) == (64, 32) for r in rows)
