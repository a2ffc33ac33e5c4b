#!/usr/bin/env python
"""A dense bf16 GEMM's rate in a burst and held for seconds, beside the SM clock and power the card held: how much of
a GEMM's rate a step can keep once the card sits at its power limit.

Why: on an H100 both moetron's and torchtitan's steps run at the 700 W limit with the SM clock near 1,500 MHz of
1,980 (docs/performance.md, session 57), and the H200's GEMMs in the step ran 4% slower than the H100's (session 56).
Short GEMM benchmarks (tools/cli.py ``median_ms``: tens of milliseconds) run before the clock falls. This one runs
``[M, K] @ [K, N]`` back to back:

- ``burst``: ``--burst`` calls after a second of idle, timed together (what a short GEMM benchmark sees; the clock
  is whatever the card ramps to from idle, not read: nvidia-smi's first sample comes later);
- ``held``: after ``--settle`` seconds of the same calls, ``--seconds`` more, timed in samples of ``--loop`` calls,
  with tools/clocks.py's ClockSampler over them (nvidia-smi every 200 ms): mean TFLOP/s, mean SM clock, power.

Each row also gives the dense bf16 peak at the held clock (``FLOP_PER_CLOCK_SM`` x SMs x MHz) and the GEMM's share of
it, so a slower held rate can be told apart as the clock's (the power cap) or the kernel's. Random normal
operands (the power a GEMM draws depends on its data; a step's activations and weights are near normal too).

    python tools/bench_gemm_clock.py --json runs/bench/gemm_clock.json
    python tools/bench_gemm_clock.py --shapes 16384x4096x4096,65536x4096x8192 --seconds 8
    python tools/bench_gemm_clock.py --tiny          # the CPU: a small shape, no clock (the tests)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from clocks import ClockSampler  # noqa: E402  (tools/: the SM clock and power sampler)
from cli import run_cli, timed_ms, write_report  # noqa: E402

from moetron.core.config import ConfigError  # noqa: E402
from moetron.core.metrics import run_environment  # noqa: E402

FLOP_PER_CLOCK_SM = 4096
"""Dense bf16 tensor-core FLOPs per clock per SM on Hopper (H100 / H200 SXM): the datasheet's 989.4 TFLOP/s is
132 SMs x 1,830 MHz x 4,096."""

DEFAULT_SHAPES = "16384x4096x4096,16384x4096x100352"
"""M x K x N: olmoe3-4l-8e's attention projection and its LM head over a 16,384-token step (docs/performance.md,
session 56's GEMM table)."""


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        m, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--shapes: {text!r} should read MxKxN, e.g. 16384x4096x4096") from None
    if min(m, k, n) < 1:
        raise ConfigError(f"--shapes: {text!r} has a dimension below 1")
    return m, k, n


def peak_tflops(sms: int | None, mhz: float | None) -> float | None:
    """The dense bf16 peak (TFLOP/s) of ``sms`` SMs at ``mhz``; None without either."""
    return FLOP_PER_CLOCK_SM * sms * mhz * 1e6 / 1e12 if sms and mhz else None


def measure(shape: tuple[int, int, int], device: torch.device, burst: int, settle: float, seconds: float,
            loop: int, idle: float = 1.0) -> dict:
    m, k, n = shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
    b = torch.randn(k, n, generator=gen).to(device, torch.bfloat16)
    out = torch.empty(m, n, device=device, dtype=torch.bfloat16)

    def gemm():
        torch.mm(a, b, out=out)

    flop = 2.0 * m * k * n
    timed_ms(gemm, device, 3)  # cuBLAS's choice and workspace, once
    time.sleep(idle)  # idle before the burst, as a short benchmark starts (the card drops its clock: 345 MHz)
    burst_s = timed_ms(gemm, device, burst) / 1e3
    t_end = time.monotonic() + settle
    while time.monotonic() < t_end:
        timed_ms(gemm, device, loop)
    samples = []
    with ClockSampler(device) as clocks:
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end or not samples:
            samples.append(timed_ms(gemm, device, loop) / 1e3)
    row = {"shape": f"{m}x{k}x{n}", "m": m, "k": k, "n": n,
           "burst_tflops": flop * burst / burst_s / 1e12, "burst_ms": burst_s * 1e3,
           "held_tflops": flop * loop * len(samples) / sum(samples) / 1e12,
           "held_samples": len(samples)}
    row.update(clocks.summary())
    row["sms"] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
    row["peak_at_clock_tflops"] = peak_tflops(row["sms"], row["sm_clock_mhz"])
    row["share_of_peak_at_clock"] = (row["held_tflops"] / row["peak_at_clock_tflops"]
                                     if row["peak_at_clock_tflops"] else None)
    return row


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma-separated MxKxN ({DEFAULT_SHAPES})")
    p.add_argument("--burst", type=int, default=10, help="calls timed together after a second of idle")
    p.add_argument("--settle", type=float, default=3.0, help="seconds of calls before the held window")
    p.add_argument("--seconds", type=float, default=5.0, help="the held window, seconds")
    p.add_argument("--loop", type=int, default=20, help="calls a timed sample in the held window")
    p.add_argument("--tiny", action="store_true", help="the CPU (or GPU) with one 256x256x256 shape, short windows")
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args(argv)
    for name in ("burst", "loop"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} {getattr(args, name)}: at least 1")
    for name in ("settle", "seconds"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name} {getattr(args, name)}: at least 0")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.tiny:
        shapes, args.settle, args.seconds, args.burst, args.loop = [(256, 256, 256)], 0.0, 0.05, 2, 2
        idle = 0.0
    else:
        shapes, idle = [parse_shape(s) for s in args.shapes.split(",") if s], 1.0
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.tiny:
        device = torch.device("cpu")
    else:
        print("bench_gemm_clock: needs a GPU (or --tiny, which runs on the CPU)", file=sys.stderr)
        return 1
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"bf16 GEMM, burst ({args.burst} calls after {idle:g} s idle) and held ({args.seconds:g} s after "
          f"{args.settle:g} s), {name}")
    print(f"{'M x K x N':<22} {'burst TF/s':>10} {'held TF/s':>9} {'SM MHz':>7} {'min':>5} {'W':>5} "
          f"{'peak@MHz':>8} {'held/peak':>9}")
    rows = []
    for shape in shapes:
        row = measure(shape, device, args.burst, args.settle, args.seconds, args.loop, idle)
        rows.append(row)
        print(f"{row['shape']:<22} {row['burst_tflops']:>10.1f} {row['held_tflops']:>9.1f} "
              f"{_fmt(row['sm_clock_mhz'], '.0f'):>7} {_fmt(row['sm_clock_min_mhz'], '.0f'):>5} "
              f"{_fmt(row['power_w'], '.0f'):>5} {_fmt(row['peak_at_clock_tflops'], '.0f'):>8} "
              f"{_fmt(row['share_of_peak_at_clock'], '.1%'):>9}")
    argv = sys.argv[1:] if argv is None else argv
    write_report(args.json, run_environment(device, 1, "tools/bench_gemm_clock.py", argv), rows)
    return 0


if __name__ == "__main__":
    run_cli(main)
