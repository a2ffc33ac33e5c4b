"""tools/cli.py median_ms: the median of per-call times, a sample being ``loop`` back-to-back calls."""

import pytest

import cli  # tools/ (tests/conftest.py puts it on sys.path)


def test_median_ms_counts_calls_and_divides_by_loop(monkeypatch):
    """On the CPU (the wall clock, replaced by a counter here): warm-up calls untimed, each sample
    ``loop`` calls, the result per call; the median of odd and even sample counts."""
    import time

    calls = []
    clock = iter(range(0, 10_000))
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock) / 1e3)  # 1 ms per reading

    def fn():
        calls.append(1)
        next(clock)  # each call costs one more tick: a sample of n calls spans n + 1 ms

    got = cli.median_ms(fn, "cpu", warmup=2, iters=3, loop=4)
    assert len(calls) == 2 + 3 * 4
    assert got == pytest.approx(5 / 4)  # (4 calls + the end reading) / 4 per call
    calls.clear()
    assert cli.median_ms(fn, "cpu", warmup=0, iters=4, loop=1) == pytest.approx(2.0) and len(calls) == 4
    with pytest.raises(ValueError, match="loop must be at least 1"):
        cli.median_ms(fn, "cpu", loop=0)
