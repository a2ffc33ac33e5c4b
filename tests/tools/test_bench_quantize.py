"""tools/bench_quantize.py --tiny on the CPU (Triton interpreted): one row per shape with a timing
per autotune config, the autotuned one and the config it chose."""

import json
import os
import sys

import pytest

from tests.interpreted import skip_unless_interpreter_works
from tests.processes import run_python

pytestmark = pytest.mark.slow  # among the longest modules: run first (tests/conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tiny_rows(tmp_path, *flags) -> list[dict]:
    """bench_quantize.py --tiny [flags] run in a subprocess (Triton interpreted): its JSON rows."""
    out = tmp_path / "quantize.json"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    proc = run_python([os.path.join(ROOT, "tools", "bench_quantize.py"), "--tiny", *flags,
                       "--json", str(out)], timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())["rows"]


def test_tiny_run_times_each_config(tmp_path):
    """The [256, 256] row: the copy, each config, the autotuned kernel, the rows output alone and the
    config chosen. Two experts, not the default 8: the tokens output's padding index then has 512
    rows (two 128-row tiles of x's rows, two of padding) instead of 1280, so each of the run's
    interpreted launches (one a timing: --tiny does not warm up) is 2 x 4 programs, not 2 x 10."""
    skip_unless_interpreter_works()
    (row,) = _tiny_rows(tmp_path, "--experts", "2")
    assert (row["rows"], row["cols"], row["experts"]) == (256, 256, 2) and row["copy_ms"] > 0
    assert row["w4_ms"] > 0 and row["autotuned_ms"] > 0 and row["rows_only_ms"] > 0 and row["one_read_ms"] > 0
    assert row["chosen"] == "4 warps (the product runs 4)"


def test_tiny_rowwise_sweep_reports_every_tile(tmp_path):
    """--rowwise: one row per kernel and tile of the sweep (interpreted: per tile apart from its
    warps, which the interpreter ignores), each with a time and a rate."""
    skip_unless_interpreter_works()
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import bench_quantize

    rows = _tiny_rows(tmp_path, "--rowwise")
    tiles = {(r["kind"], r["tile"]) for r in rows}

    def swept(tiles, launch):  # interpreted: one tile per launch apart from num_warps
        kept = bench_quantize.sweep(tiles, True, launch)
        assert len({launch(t) for t in tiles}) == len(kept) and len(kept) >= 4
        return kept

    assert {("rowwise_rows", label) for label, _ in swept(bench_quantize.ROWS_TILES, bench_quantize.rows_launch)} <= tiles
    assert {("rowwise_chunk_amax", f"{k}x{c} w{w}") for k, c, w in swept(bench_quantize.CHUNK_TILES, lambda t: t[:2])} <= tiles
    assert {("rowwise_group_amax", f"u{u}x{c} w{w}") for u, c, w in swept(bench_quantize.GROUP_TILES, lambda t: t[:2])} <= tiles
    assert {("rowwise_rows_chunks", f"1pass<={o} {sr}r w{w}")
            for o, sr, w in swept(bench_quantize.ROWS_CHUNKS_TILES, lambda t: t[:2])} <= tiles
    assert ("rowwise_rows", "1pass 4k w8") not in tiles  # 1pass 4k w4's program, interpreted again
    assert {("rowwise_rows+cols", "separate"), ("rowwise_rows+cols", "fused")} <= tiles
    assert {"rowwise_group_cols", "rowwise_stacked_cols", "rowwise_copy"} <= {r["kind"] for r in rows}
    assert all(r["ms"] > 0 and r["tb_s"] > 0 for r in rows)


def test_tiny_mx_sweep_reports_every_tile(tmp_path):
    """--mx: a copy row and one row per tile of the sweep in each order (--mx-order's default: both),
    each with a time and a rate."""
    skip_unless_interpreter_works()
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import bench_quantize

    rows = _tiny_rows(tmp_path, "--mx")
    kept = bench_quantize.sweep(bench_quantize.MX_TILES, True, lambda t: (t[0], t[2]))
    assert len(kept) == len({(c, codes) for c, _, codes in bench_quantize.MX_TILES}) >= 5
    orders = ["rows-first", "cols-first"]
    assert [(r["tile"], r["order"]) for r in rows] == [("copy", None)] + [
        (bench_quantize.mx_tile_label(*t), o) for o in orders for t in kept]
    assert "128 cols w4 tile-codes" in {r["tile"] for r in rows}
    assert all(r["kind"] == "mx_rows_and_cols" and r["ms"] > 0 and r["tb_s"] > 0 for r in rows)
