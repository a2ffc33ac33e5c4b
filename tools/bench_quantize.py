#!/usr/bin/env python
"""The fused FP8 1x128 quantization kernel (core/precision/blockwise_triton.py quantize_1x128_fused:
rows output, transposed tokens output through an 8-expert padding index, 3 spare rows as the
cuBLAS experts want) under each of its autotune configs alone, then autotuned, beside a plain copy
of the input: ms and TB/s of traffic (the bf16 read and two e4m3 writes); and the rows output alone
(autotuned: what precision.fp8_wgrad=false quantizes; the bf16 read and one e4m3 write).

    python tools/bench_quantize.py --json runs/bench/quantize.json
    python tools/bench_quantize.py --tiny        # tiny shapes; on the CPU under TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

SHAPES = [(65536, 4096), (65536, 8192), (131072, 2048)]  # olmoe3-4l-8e's x / dy, OLMoE's x
TINY_SHAPES = [(256, 256)]


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (runs on the CPU, Triton interpreted)")
    p.add_argument("--experts", type=int, default=8, help="expert groups of the tokens output's padding")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default="", help="write the results here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cli import kernel_device  # tools/cli.py (imports no triton)

    device = kernel_device(args.tiny, "bench_quantize")
    if device is None:
        return 2
    from cli import median_ms, write_report  # tools/cli.py

    from moetron.core.metrics import run_environment
    from moetron.core.precision import blockwise_triton as bt
    from moetron.core.precision.fp8_cublas import ROW_SLACK
    from moetron.core.precision.grouping import padded_source_rows

    iters = 1 if args.tiny else args.iters
    candidates = bt._quantize_configs(device.type == "cpu")
    rows = []
    print(f"{'x':<16} {'copy ms':>8} " + " ".join(f"{'w%d' % c.num_warps:>14}" for c in candidates)
          + f" {'autotuned':>14} {'rows only':>14}  chosen   (cells: ms / TB/s)")
    for R, C in TINY_SHAPES if args.tiny else SHAPES:
        x = torch.randn(R, C, device=device).bfloat16()
        E = args.experts
        offsets = (torch.arange(1, E + 1, device=device) * (R // E)).to(torch.int32)
        src, _ = padded_source_rows(offsets, R, 128)
        traffic = x.numel() * (2 + 1 + 1)
        quantize = lambda: bt.quantize_1x128_fused(x, True, True, src, R + ROW_SLACK)  # noqa: E731
        row = {"kind": "quantize_1x128", "rows": R, "cols": C, "experts": E,
               "copy_ms": median_ms(lambda: x.clone(), device, warmup=2, iters=iters)}
        cells = []
        try:
            for c in candidates:
                bt.use_quantize_configs([c])
                ms = median_ms(quantize, device, warmup=2, iters=iters)
                row[f"w{c.num_warps}_ms"] = ms
                cells.append(f"{ms:6.3f}/{traffic / ms / 1e9:5.2f}")
        finally:
            bt.use_quantize_configs(candidates)
        row["autotuned_ms"] = median_ms(quantize, device, warmup=2, iters=iters)
        best = bt._fp8_quantize_1x128_kernel.best_config
        row["chosen"] = f"{best.num_warps} warps"
        row["autotuned_tb_s"] = traffic / row["autotuned_ms"] / 1e9
        row["rows_only_ms"] = median_ms(lambda: bt.quantize_1x128_fused(x, True, False, src, R + ROW_SLACK), device,
                                        warmup=2, iters=iters)
        row["rows_only_tb_s"] = x.numel() * (2 + 1) / row["rows_only_ms"] / 1e9
        rows.append(row)
        print(f"{f'[{R}, {C}]':<16} {row['copy_ms']:>8.3f} " + " ".join(f"{c:>14}" for c in cells)
              + f" {row['autotuned_ms']:>6.3f}/{row['autotuned_tb_s']:5.2f}"
              + f" {row['rows_only_ms']:>6.3f}/{row['rows_only_tb_s']:5.2f}  {row['chosen']}", flush=True)
    env = run_environment(device, 1, "tools/bench_quantize.py", sys.argv[1:] if argv is None else argv)
    write_report(args.json, env, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
