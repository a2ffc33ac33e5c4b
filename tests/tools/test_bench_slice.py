"""tools/bench_slice.py on the CPU (tiny widths): the slice is one stage's MoE blocks with E/ep local
experts receiving T x K rows; variants are measured and written; bad layouts fail clearly."""

import json

import pytest
import torch

import bench_slice
from moetron.core.config import ConfigError


def test_tiny_slice_runs_and_reports(tmp_path):
    out = tmp_path / "slice.json"
    bench_slice.main(["--tiny", "--seq-len", "32", "--steps", "1", "--warmup", "0", "--load", "skewed",
                      "--json", str(out), "--variant", "none:memory.recompute=none",
                      "--variant", "full:memory.recompute=full"])
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["none", "full"]
    r = rows[0]
    assert r["local_experts"] == 16 and r["tokens"] == 32 and r["rows"] == 32 * 4  # moe-1t: 128 / ep 8, top-4
    counts = r["rows_per_local_expert"]
    assert sum(counts) == 128 and counts == sorted(counts, reverse=True) and counts[0] > counts[-1]
    assert r["layers"] == [2, 3]  # the first MoE blocks (0 and 1 are dense)
    assert all(x["tflops_per_gpu"] > 0 for x in rows)


def test_arriving_rows_dispatch_combines_every_slot_once():
    counts = bench_slice.local_counts(12, 3, "uniform")
    assert counts.tolist() == [4, 4, 4]
    disp = bench_slice.ArrivingRows(counts, num_tokens=6, top_k=2)
    x = torch.randn(6, 5)
    d = disp.dispatch(x, None, 8, None)
    w = torch.rand(6, 2)
    out = disp.combine(d.x_RD * 2.0, w, d)  # "experts" double their rows
    torch.testing.assert_close(out, 2.0 * x * w.sum(1, keepdim=True))


def test_bad_slices():
    with pytest.raises(ConfigError, match="must divide the 128 experts"):
        bench_slice.main(["--tiny", "--ep", "3", "--json", ""])
    with pytest.raises(ConfigError, match="exceeds one stage"):
        bench_slice.main(["--tiny", "--layers", "9", "--json", ""])
