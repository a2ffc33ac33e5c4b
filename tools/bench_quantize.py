#!/usr/bin/env python
"""The fused FP8 1x128 quantization kernel (core/precision/blockwise_triton.py quantize_1x128_fused:
rows output, transposed tokens output through an 8-expert padding index, 3 spare rows as the
cuBLAS experts want) under each candidate config alone (4 and 8 warps), then autotuned over them,
beside a plain copy of the input: ms and TB/s of traffic (the bf16 read and two e4m3 writes); the
rows output alone (the product's config, blockwise_triton.QUANTIZE_WARPS: what precision.fp8_wgrad=false
quantizes; the bf16 read and one e4m3 write); and both outputs from the one-read kernel
(blockwise_triton.TOKENS_FROM_TILE: the tile read once, the tokens transposed in registers; TILE_WARPS).

    python tools/bench_quantize.py --json runs/bench/quantize.json
    python tools/bench_quantize.py --tiny        # tiny shapes; on the CPU under TRITON_INTERPRET=1

With --rowwise, the fp8_rowwise recipe's kernels instead (core/precision/fp8_rowwise_triton.py):
the rows quantization, the per-16-row column amax, the per-group max of those, and the fused rows
+ column maxima kernel under each tile of a sweep (TILES), the whole per-expert column quantization,
a grouped operand quantized for both its GEMMs in two reads or one (precision.fp8_fused_amax), a
weight's stacked columns; ms and TB/s of their traffic.

    python tools/bench_quantize.py --rowwise --json runs/bench/quantize_rowwise.json

With --mx, mxfp8's fused kernel (core/precision/mx_triton.py mx_rows_and_cols_triton: an operand's
rows quantize-dequantized to bf16 and its columns along 32-row blocks, from one read) under each tile
of a sweep (MX_TILES: columns per program x warps, and the E8M0 codes stored from the tile's
layout or through shared memory), at OLMoE-8L's operands: the routed x gathered
into 64 experts' padded rows with the columns as a payload (e4m3 + E8M0, what the forward saves),
its output gradient with bf16 columns (the backward's), and a dense linear's x; ms and TB/s of their
traffic (the bf16 read, the bf16 rows write, the columns' write), beside a plain copy. Each sample is
``--loop`` back-to-back calls. Sessions 22-23 waited for every call, so each Python launch's host time
(tens of microseconds against 0.1-0.7 ms kernels) was timed too; session 23's first sweep put two
rows that run the same kernel (tile-codes changes only the payload form) 13% apart. Each tile runs
in each order of ``--mx-order`` (mx_triton.GRID_COLS_FIRST: rows-first, the tiles handed out down a
column strip of row blocks; cols-first, along each block of 32 rows).

    python tools/bench_quantize.py --mx --json runs/bench/quantize_mx.json
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
    p.add_argument("--loop", type=int, default=10,
                   help="--mx: back-to-back calls per timed sample (cli.median_ms; 1 counts each launch's host time)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--rowwise", action="store_true", help="the fp8_rowwise kernels and their tile sweep")
    kind.add_argument("--mx", action="store_true", help="mxfp8's fused rows + columns kernel and its tile sweep")
    p.add_argument("--mx-order", default="rows-first,cols-first",
                   help="--mx: the tile orders to sweep, comma-separated (mx_triton.GRID_COLS_FIRST)")
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args(argv)
    args.mx_order = [o for o in args.mx_order.split(",") if o]
    if not args.mx_order or any(o not in ("rows-first", "cols-first") for o in args.mx_order):
        p.error(f"--mx-order takes rows-first and/or cols-first, comma-separated; got {','.join(args.mx_order)!r}")
    return args


# OLMoE-8L's x (top-8 of 64), olmoe3-4l-8e's x (top-4 of 8) and its gate|up output gradient (8192 columns:
# wider than the fused kernel's default tile serves, fp8_rowwise_triton.rows_chunks_fits)
ROWWISE_SHAPES = [(131072, 2048, 64), (65536, 4096, 8), (65536, 8192, 8)]
ROWS_TILES = [  # (label, TILES["rows"]): session 11's kernel (4 rows, two passes of 512), then one pass
    ("2pass 4x512 w4", {"elements": 2048, "max_rows": 4, "one_pass_cols": 0, "cols": 512, "num_warps": 4}),
    *((f"1pass {e // 1024}k w{w}", {"elements": e, "max_rows": 64, "one_pass_cols": 8192, "cols": 1024, "num_warps": w})
      for e in (4096, 8192, 16384) for w in (4, 8)),
]
CHUNK_TILES = [(1, 512, 2), (1, 512, 4), (1, 1024, 4), (1, 1024, 8), (2, 1024, 4), (4, 1024, 4), (1, 2048, 8)]  # chunks, cols, warps
GROUP_TILES = [(8, 256, 2), (4, 256, 2), (16, 256, 2), (8, 512, 4), (8, 128, 1)]  # unroll, cols, warps
ROWS_CHUNKS_TILES = [(8192, 8, 0), (8192, 4, 0), (8192, 16, 0), (8192, 8, 2), (8192, 8, 4), (8192, 8, 8),
                     (1024, 8, 4), (8192, 2, 8), (8192, 4, 8), (4096, 8, 8), (2048, 8, 4)]
# one_pass_cols, sub_rows, warps (0: one per 512 columns); one_pass_cols below C: two passes of 1024 columns


def sweep(tiles: list, interpreted: bool, launch) -> list:
    """The tiles a sweep runs: all of them on a GPU; interpreted (--tiny on the CPU: TRITON_INTERPRET=1
    ignores num_warps) the first of each group that ``launch(tile)`` (the tile without its warps)
    makes the same, since the others would interpret the same program again."""
    if not interpreted:
        return list(tiles)
    first = {}
    for tile in tiles:
        first.setdefault(launch(tile), tile)
    return list(first.values())


def rows_launch(tile):  # a ROWS_TILES entry without its warps
    return tuple(sorted((k, v) for k, v in tile[1].items() if k != "num_warps"))


def timing(args) -> tuple[int, int]:
    """(warm-up calls, timed calls) of every mode: --tiny checks that each row runs (interpreted, one
    call each, no warm-up), otherwise 2 and --iters."""
    return (0, 1) if args.tiny else (2, args.iters)


def rowwise(args, device) -> list[dict]:
    from cli import median_ms  # tools/cli.py

    from moetron.core.precision import fp8_rowwise_triton as kt
    from moetron.core.precision.fp8_rowwise import ALIGN, quantize_group_cols
    from moetron.core.precision.grouping import padded_source_rows

    warmup, iters = timing(args)
    shapes = [(128, 256, 2)] if args.tiny else ROWWISE_SHAPES
    saved = {k: dict(v) for k, v in kt.TILES.items()}
    out = []

    def row(kernel, shape, label, fn, traffic):
        ms = median_ms(fn, device, warmup=warmup, iters=iters)
        out.append({"kind": f"rowwise_{kernel}", "shape": list(shape), "tile": label, "ms": ms,
                    "tb_s": traffic / ms / 1e9})
        print(f"{kernel:<14} {str(list(shape)):<20} {label:<18} {ms:8.3f} ms {traffic / ms / 1e9:6.2f} TB/s", flush=True)

    print(f"{'kernel':<14} {'shape':<20} {'tile':<18} {'ms':>11} {'TB/s':>11}")
    try:
        for R, C, E in shapes:
            x = torch.randn(R, C, device=device).bfloat16()
            offsets = (torch.arange(1, E + 1, device=device) * (R // E)).to(torch.int32)
            src, padded = padded_source_rows(offsets, R, ALIGN)
            P = src.numel()
            row("copy", (R, C), "x.clone()", lambda: x.clone(), 4 * x.numel())
            for label, tiles in sweep(ROWS_TILES, device.type == "cpu", rows_launch):
                kt.TILES["rows"] = tiles
                row("rows", (R, C), label, lambda: kt.quantize_rows(x), 3 * x.numel())
            kt.TILES["rows"] = saved["rows"]
            for k, c, w in sweep(CHUNK_TILES, device.type == "cpu", lambda t: t[:2]):
                kt.TILES["chunk_amax"] = {"chunks": k, "cols": c, "num_warps": w}
                row("chunk_amax", (P, C), f"{k}x{c} w{w}", lambda: kt.chunk_amax(x, src), 2 * P * C + 4 * P * C // kt.CHUNK)
            kt.TILES["chunk_amax"] = saved["chunk_amax"]
            partials, ends = kt.chunk_amax(x, src), padded // kt.CHUNK
            for u, c, w in sweep(GROUP_TILES, device.type == "cpu", lambda t: t[:2]):
                kt.TILES["group_amax"] = {"unroll": u, "cols": c, "num_warps": w, "programs": saved["group_amax"]["programs"]}
                row("group_amax", tuple(partials.shape), f"u{u}x{c} w{w}", lambda: kt.group_amax(partials, ends),
                    4 * partials.numel())
            kt.TILES["group_amax"] = saved["group_amax"]
            row("group_cols", (P, C), "default", lambda: quantize_group_cols(x, src, padded, "triton"),
                2 * P * C * 2 + P * C + 8 * P * C // kt.CHUNK)
            for o, sr, w in sweep(ROWS_CHUNKS_TILES, device.type == "cpu", lambda t: t[:2]):  # the rows and the chunks' column maxima in one read
                kt.TILES["rows_chunks"] = {**saved["rows_chunks"], "one_pass_cols": o, "sub_rows": sr, "num_warps": w}
                row("rows_chunks", (P, C), f"1pass<={o} {sr}r w{w}", lambda: kt.quantize_rows_chunks(x, src),
                    3 * P * C + 4 * P * C // kt.CHUNK)
            kt.TILES["rows_chunks"] = saved["rows_chunks"]
            # a grouped operand for both its GEMMs (fp8_rowwise._rows_and_group_cols): two reads, or one
            # (precision.fp8_fused_amax); the traffic counted is the fused path's
            both = 3 * P * C + 2 * P * C + P * C + 8 * P * C // kt.CHUNK
            row("rows+cols", (P, C), "separate", lambda: (kt.quantize_rows(x), quantize_group_cols(x, src, padded, "triton")),
                both)
            # the fused kernel at every width; fp8_rowwise runs it only where rows_chunks_fits(C)
            fused_label = "fused" if kt.rows_chunks_fits(C) else "fused (training runs the two kernels)"
            row("rows+cols", (P, C), fused_label, lambda: quantize_group_cols(x, src, padded, "triton",
                                                                          chunks=kt.quantize_rows_chunks(x, src)[2]), both)
        # --tiny: a few programs each (interpreted, the cost is per program: [4, 256, 128] was 1024 rows)
        w = torch.randn(*((2, 64, 128) if args.tiny else (64, 2048, 2048)), device=device)
        row("stacked_cols", tuple(w.shape), "default", lambda: kt.quantize_stacked_cols(w), 9 * w.numel())
        xd = torch.randn(*((1, 256, 128) if args.tiny else (1, 16384, 2048)), device=device).bfloat16()  # a dense wgrad's x
        row("stacked_cols", tuple(xd.shape), "default", lambda: kt.quantize_stacked_cols(xd), 5 * xd.numel())
        for label, tiles in ROWS_TILES[:1] + ROWS_TILES[3:4]:
            kt.TILES["rows"] = tiles
            row("rows fp32 w", tuple(w.shape), label, lambda: kt.quantize_rows(w.view(-1, w.shape[-1])), 5 * w.numel())
    finally:
        kt.TILES.update(saved)
    return out


MX_TILES = [(64, 4, False), (128, 4, False), (128, 8, False), (256, 4, False), (256, 8, False), (512, 8, False),
            (64, 2, False), (128, 2, False),  # fewer threads, more bytes in flight each (session 23, call 2:
            # 128 on 2 warps 13% faster on the payload x, 6% slower on dy than on 4; not timed in a step)
            (128, 4, True), (256, 4, True), (128, 2, True)]  # columns per program, warps, E8M0 codes from the tile
MX_SHAPES = [  # (label, rows, cols, experts or 0 for a dense operand, columns as payload)
    ("expert x", 131072, 2048, 64, True), ("expert dy", 131072, 2048, 64, False), ("dense x", 16384, 2048, 0, True)]


def mx_tile_label(cols: int, warps: int, codes_from_tile: bool) -> str:
    return f"{cols} cols w{warps}" + (" tile-codes" if codes_from_tile else "")


def mx(args, device) -> list[dict]:
    """mx_rows_and_cols_triton under each tile of MX_TILES (see the module docstring)."""
    from cli import median_ms  # tools/cli.py

    from moetron.core.precision import mx_triton
    from moetron.core.precision.grouping import padded_source_rows

    warmup, iters = timing(args)
    shapes = [("tiny", 256, 128, 4, True)] if args.tiny else MX_SHAPES
    saved, saved_order = dict(mx_triton.TILES["both"]), mx_triton.GRID_COLS_FIRST
    out = []
    print(f"{'operand':<10} {'shape':<16} {'tile':<25} {'ms':>8} {'TB/s':>6}")

    def row(label, R, C, E, payload, tile, fn, traffic, order=None):
        ms = median_ms(fn, device, warmup=warmup, iters=iters, loop=1 if args.tiny else args.loop)
        out.append({"kind": "mx_rows_and_cols", "operand": label, "shape": [R, C], "experts": E,
                    "cols_payload": payload, "tile": tile, "order": order, "ms": ms, "tb_s": traffic / ms / 1e9})
        name = tile if order is None else f"{tile} {order}"
        print(f"{label:<10} {str([R, C]):<16} {name:<25} {ms:8.3f} {traffic / ms / 1e9:6.2f}", flush=True)

    try:
        for label, R, C, E, payload in shapes:
            x = torch.randn(R, C, device=device).bfloat16()
            src = ends = None
            P = -(-R // 32) * 32
            if E:
                ends = (torch.arange(1, E + 1, device=device) * (R // E)).to(torch.int32)
                src, _ = padded_source_rows(ends, R, 32)
                P = src.numel()
            row(label, R, C, E, payload, "copy", lambda: x.clone(), 4 * R * C)
            traffic = 2 * R * C + 2 * R * C + (P * C + P * C // 32 if payload else 2 * P * C)
            for order in args.mx_order:
                mx_triton.GRID_COLS_FIRST = order == "cols-first"
                for cols, warps, codes in sweep(MX_TILES, device.type == "cpu", lambda t: (t[0], t[2])):
                    mx_triton.TILES["both"] = {"cols": cols, "num_warps": warps, "codes_from_tile": codes}
                    row(label, R, C, E, payload, mx_tile_label(cols, warps, codes),
                        lambda: mx_triton.mx_rows_and_cols_triton(x, src, ends, "rceil", payload), traffic, order)
    finally:
        mx_triton.TILES["both"] = saved
        mx_triton.GRID_COLS_FIRST = saved_order
    return out


def main(argv=None) -> int:
    args = parse(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cli import kernel_device  # tools/cli.py (imports no triton)

    device = kernel_device(args.tiny, "bench_quantize")
    if device is None:
        return 2
    from cli import median_ms, write_report  # tools/cli.py

    from moetron.core.metrics import run_environment

    if args.rowwise or args.mx:
        rows = rowwise(args, device) if args.rowwise else mx(args, device)
        write_report(args.json, run_environment(device, 1, "tools/bench_quantize.py", sys.argv[1:] if argv is None else argv),
                     rows)
        return 0
    from moetron.core.precision import blockwise_triton as bt
    from moetron.core.precision.fp8_cublas import ROW_SLACK
    from moetron.core.precision.grouping import padded_source_rows

    warmup, iters = timing(args)
    candidates = bt._quantize_configs(device.type == "cpu")
    rows = []
    print(f"{'x':<16} {'copy ms':>8} " + " ".join(f"{'w%d' % c.num_warps:>14}" for c in candidates)
          + f" {'autotuned':>14} {'rows only':>14} {'one read':>14}  chosen   (cells: ms / TB/s)")
    for R, C in TINY_SHAPES if args.tiny else SHAPES:
        x = torch.randn(R, C, device=device).bfloat16()
        E = args.experts
        offsets = (torch.arange(1, E + 1, device=device) * (R // E)).to(torch.int32)
        src, _ = padded_source_rows(offsets, R, 128)
        traffic = x.numel() * (2 + 1 + 1)
        quantize = lambda: bt.quantize_1x128_fused(x, True, True, src, R + ROW_SLACK)  # noqa: E731
        row = {"kind": "quantize_1x128", "rows": R, "cols": C, "experts": E,
               "copy_ms": median_ms(lambda: x.clone(), device, warmup=warmup, iters=iters)}
        cells = []
        try:
            for c in candidates:
                bt.use_quantize_configs([c])
                ms = median_ms(quantize, device, warmup=warmup, iters=iters)
                row[f"w{c.num_warps}_ms"] = ms
                cells.append(f"{ms:6.3f}/{traffic / ms / 1e9:5.2f}")
            bt.use_quantize_configs(candidates)
            row["autotuned_ms"] = median_ms(quantize, device, warmup=warmup, iters=iters)
            best = bt._fp8_quantize_1x128_kernel.best_config
            row["chosen"] = f"{best.num_warps} warps (the product runs {bt.QUANTIZE_WARPS})"
        finally:
            bt.use_quantize_configs(bt.QUANTIZE_CONFIGS)
        row["autotuned_tb_s"] = traffic / row["autotuned_ms"] / 1e9
        row["rows_only_ms"] = median_ms(lambda: bt.quantize_1x128_fused(x, True, False, src, R + ROW_SLACK), device,
                                        warmup=warmup, iters=iters)
        row["rows_only_tb_s"] = x.numel() * (2 + 1) / row["rows_only_ms"] / 1e9
        default, bt.TOKENS_FROM_TILE = bt.TOKENS_FROM_TILE, True
        try:
            row["one_read_ms"] = median_ms(quantize, device, warmup=warmup, iters=iters)
        finally:
            bt.TOKENS_FROM_TILE = default
        row["one_read_tb_s"] = traffic / row["one_read_ms"] / 1e9
        rows.append(row)
        print(f"{f'[{R}, {C}]':<16} {row['copy_ms']:>8.3f} " + " ".join(f"{c:>14}" for c in cells)
              + f" {row['autotuned_ms']:>6.3f}/{row['autotuned_tb_s']:5.2f}"
              + f" {row['rows_only_ms']:>6.3f}/{row['rows_only_tb_s']:5.2f}"
              + f" {row['one_read_ms']:>6.3f}/{row['one_read_tb_s']:5.2f}  {row['chosen']}", flush=True)
    env = run_environment(device, 1, "tools/bench_quantize.py", sys.argv[1:] if argv is None else argv)
    write_report(args.json, env, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
