"""tools/bench_slice.py on the CPU (tiny widths): the slice is one stage's MoE blocks with E/ep local
experts receiving T x K rows; variants are measured and written; bad layouts fail clearly."""

import json

import pytest
import torch

import bench_slice
from moetron.core.config import ConfigError
from moetron.core.memory import MemoryConfig


def test_tiny_slice_runs_and_reports(tmp_path, capsys):
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
    # the planner's figures for the same slice beside each measured row (tools/plan.py plan_slice)
    import plan as planner

    cfg, _ = bench_slice.slice_config(bench_slice_args())
    for x, recompute in zip(rows, ("none", "full")):
        p = planner.plan_slice(cfg, x["layers"], ep=8, seq_len=32, memory=MemoryConfig(recompute=recompute),
                               compiled=False, gpu="h200")
        assert x["planned_step_s"] == p["step_s"] and x["planned_peak_mem_gib"] == p["peak_gib"]
        assert x["planned_tflops_per_gpu"] == p["tflops_per_gpu"]
        assert x["step_error"] == pytest.approx(p["step_s"] / x["step_s"] - 1)
        assert x["tflops_error"] == pytest.approx(p["tflops_per_gpu"] / x["tflops_per_gpu"] - 1)
        assert x["peak_error"] is None  # no peak measured off CUDA
    assert rows[1]["planned_step_s"] > rows[0]["planned_step_s"]  # full recompute plans slower
    text = capsys.readouterr().out
    assert "plan ms" in text and "plan TF/s" in text and "plan GiB" in text and "tools/plan.py --slice" in text


def bench_slice_args(**kw):
    """bench_slice's parsed defaults for a --tiny run (its slice_config reads preset, tiny, ep, pp, layers)."""
    import argparse

    return argparse.Namespace(**{"preset": "moe-1t", "tiny": True, "ep": 8, "pp": 8, "layers": 2, **kw})


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
