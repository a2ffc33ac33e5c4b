"""tools/bench_gemm_clock.py: its FLOP rates from the timings it is given, the peak at a clock against the
datasheet's, its shapes' errors, and a tiny run on the CPU end to end (no clock there: None, not a made-up one)."""

import json

import pytest
import torch

import bench_gemm_clock
from moetron.core.config import ConfigError


def test_peak_at_clock_is_the_datasheet_figure():
    # H100 / H200 SXM: 989.4 TFLOP/s dense bf16 at 132 SMs and 1,830 MHz (session 57's 806 at 1,491 MHz)
    assert bench_gemm_clock.peak_tflops(132, 1830) == pytest.approx(989.4, abs=0.1)
    assert bench_gemm_clock.peak_tflops(132, 1491) == pytest.approx(806.1, abs=0.1)
    assert bench_gemm_clock.peak_tflops(None, 1500) is None and bench_gemm_clock.peak_tflops(132, None) is None


def test_rates_from_timings(monkeypatch):
    calls = []

    def fake_timed(fn, device, n):  # cli.timed_ms's signature: milliseconds for n calls
        fn()
        calls.append(n)
        return n * 2.0  # 2 ms a call

    monkeypatch.setattr(bench_gemm_clock, "timed_ms", fake_timed)
    row = bench_gemm_clock.measure((64, 32, 16), torch.device("cpu"), burst=5, settle=0.0, seconds=0.0, loop=4,
                                   idle=0.0)
    flop = 2 * 64 * 32 * 16
    assert row["burst_tflops"] == pytest.approx(flop / 2e-3 / 1e12) and row["burst_ms"] == pytest.approx(10.0)
    assert row["held_tflops"] == pytest.approx(flop / 2e-3 / 1e12)
    assert calls[:2] == [3, 5] and row["held_samples"] >= 1 and set(calls[2:]) == {4}
    assert row["sm_clock_mhz"] is None and row["peak_at_clock_tflops"] is None  # the CPU has no clock to read


@pytest.mark.parametrize("text", ["12x3", "axbxc", "0x16x16"])
def test_bad_shape(text):
    with pytest.raises(ConfigError, match="--shapes"):
        bench_gemm_clock.parse_shape(text)


def test_tiny_run(tmp_path, capsys):
    out = tmp_path / "gc.json"
    assert bench_gemm_clock.main(["--tiny", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["shape"] for r in rows] == ["256x256x256"] and rows[0]["held_tflops"] > 0
    assert "256x256x256" in capsys.readouterr().out
