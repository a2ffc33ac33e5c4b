#!/usr/bin/env python
"""The FP8 blockwise grouped GEMM kernels against each other (core/precision/fp8_triton.py's
GroupedKernel: masked, the first kernels; pipelined, the default; the Gluon kernels on SM90, a row
of their own under each), against the cuBLAS loop over experts (core/precision/fp8_cublas.py, on
the GPU) and against bf16, one GEMM at a time: forward (x [R, I] -> [R, O]), dgrad (dy [R, O] ->
[R, I]) and wgrad ([E, O, I]) of each expert GEMM picked (default gate|up: I = D, O = 2F) at
tools/bench_gemm_fp8.py's layer shapes (uniform routing, R = tokens x top-k rows), 2 x R x I x O
FLOPs each.

Per (shape, GEMM, pass): bf16 ``torch._grouped_mm``, the masked, pipelined and cuBLAS-loop GEMMs, each
after its autotuning (first call, not timed); the config the pipelined kernel's autotuner chose and
its runners-up; the pipelined (and cuBLAS) output against the masked one (max |difference| over max |masked|;
exit 1 past 2^-7, one bf16 step). Operands are quantized once, outside the timing. Each row is
printed as it is measured and the JSON rewritten after each shape, so a run cut short keeps what it
finished.

    python tools/bench_fp8_variants.py --json runs/bench/fp8_variants.json
    python tools/bench_fp8_variants.py --gemms gate_up,down --iters 20     # both expert GEMMs
    python tools/bench_fp8_variants.py --tiny       # tiny shapes; on the CPU under TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

TOL = 2.0 ** -7
GEMMS = {"gate_up": lambda D, F: (D, 2 * F), "down": lambda D, F: (F, D)}  # -> (I, O)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (runs on the CPU, Triton interpreted)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per GPU")
    p.add_argument("--shapes", default="", help="comma-separated names of bench_gemm_fp8.SHAPES (default all)")
    p.add_argument("--gemms", default="gate_up", help="comma-separated: gate_up, down")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--loop", type=int, default=1,
                   help="calls a timed sample queues back to back (cli.median_ms): 1 counts each call's host time "
                   "(the Gluon path: two launches and three to five TMA descriptors a call), more leaves the GPU time")
    p.add_argument("--gluon-configs", default="4,1;3,1;4,0",
                   help="the Gluon rows kernel's rings and launches to time, 'stages,persistent[,tma_store[,group]]"
                   ";...' (SM90; the best one reported; fp8_gluon.GluonConfig: group = row tiles a raster group)")
    p.add_argument("--gluon-k-configs", default="4,1;3,1;4,0",
                   help="the Gluon wgrad kernel's, as --gluon-configs")
    p.add_argument("--json", default="", help="write the results here")
    return p.parse_args(argv)


def operands(R: int, I: int, O: int, E: int, offsets_E: torch.Tensor, device) -> dict:
    """bf16 x [R, I], w [E, O, I], dy [R, O] and their fp8 forms as fp8_gemm.py lays them out: x, dy
    1x128 along the row; w 128x128 (w and its transpose, each K-contiguous for its GEMM); dy^T and
    x^T [*, P] over each expert's rows padded to 128s, 1x128 along P (the wgrad operands; their scales
    also K-block-major, ``*_k``, as the Triton and Gluon wgrads get them)."""
    from moetron.core.precision import fp8_gemm
    from moetron.core.precision.blockwise import quantize_128x128, quantize_1x128
    from moetron.core.precision.fp8_cublas import ROW_SLACK, m_fastest
    from moetron.core.precision.grouping import pad_groups

    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(R, I, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(E, O, I, generator=g) * I ** -0.5).to(device)
    dy = torch.randn(R, O, generator=g).to(device, torch.bfloat16)
    w_q, w_s = quantize_128x128(w)  # [E, O, I], [E, O / 128, I / 128]
    x_P, padded_offsets_E = pad_groups(x, offsets_E, 128)
    dy_P, _ = pad_groups(dy, offsets_E, 128)
    slack = lambda t: quantize_1x128(torch.nn.functional.pad(t, (0, 0, 0, ROW_SLACK)), -1)  # noqa: E731
    out = dict(x=x, w=w.bfloat16(), dy=dy, x_q=quantize_1x128(x, -1), dy_q=quantize_1x128(dy, -1),
                x_q_slack=slack(x), dy_q_slack=slack(dy),
                w_q=w_q, wt_q=w_q.transpose(1, 2).contiguous(), w_s=w_s,
                dyt_q=quantize_1x128(dy_P.t().contiguous(), -1), xt_q=quantize_1x128(x_P.t().contiguous(), -1),
                padded_offsets_E=padded_offsets_E)
    # the Triton / Gluon wgrads' operands as fp8_gemm lays them out: scales K-block-major (KBLOCK_MAJOR_TOKEN_SCALES)
    if fp8_gemm.KBLOCK_MAJOR_TOKEN_SCALES:
        for k in ("dyt_q", "xt_q"):
            data, scale = out[k]
            out[k + "_k"] = (data, m_fastest(scale))
    return out


def passes(ops: dict, offsets_E: torch.Tensor) -> dict:
    """pass -> (bf16 call, fp8 call taking the kernel, the cuBLAS per-expert loop's call)."""
    from moetron.core.precision import fp8_cublas  # noqa: F401  (registers torch.ops.moetron.fp8_cublas_*)
    from moetron.core.precision import fp8_triton as ft
    from moetron.core.precision.grouping import grouped_mm_2d2d, grouped_mm_2d3d

    x_q, dy_q, w_q, wt_q, w_s = ops["x_q"], ops["dy_q"], ops["w_q"], ops["wt_q"], ops["w_s"]
    ops_ = torch.ops.moetron
    return {
        "fwd": (lambda: grouped_mm_2d3d(ops["x"], ops["w"].transpose(1, 2), offsets_E),
                lambda k: ft.fp8_grouped_mm_rows(*x_q, w_q.transpose(1, 2), w_s.transpose(1, 2), offsets_E, kernel=k),
                lambda: ops_.fp8_cublas_rows(*ops["x_q_slack"], w_q, w_s, offsets_E)),
        "dgrad": (lambda: grouped_mm_2d3d(ops["dy"], ops["w"], offsets_E),
                  lambda k: ft.fp8_grouped_mm_rows(*dy_q, wt_q.transpose(1, 2), w_s, offsets_E, kernel=k),
                  lambda: ops_.fp8_cublas_rows(*ops["dy_q_slack"], wt_q, w_s.transpose(1, 2), offsets_E)),
        "wgrad": (lambda: grouped_mm_2d2d(ops["dy"].t(), ops["x"], offsets_E),
                  lambda k: ft.fp8_grouped_mm_k(*ops.get("dyt_q_k", ops["dyt_q"]), *ops.get("xt_q_k", ops["xt_q"]),
                                                ops["padded_offsets_E"], kernel=k),
                  lambda: ops_.fp8_cublas_k(*ops["dyt_q"], *ops["xt_q"], ops["padded_offsets_E"])),
    }


def main(argv=None) -> int:
    args = parse(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cli import kernel_device  # tools/cli.py (imports no triton)

    device = kernel_device(args.tiny, "bench_fp8_variants")
    if device is None:
        return 2
    from bench_gemm_fp8 import SHAPES, TINY_SHAPES, uniform_offsets
    from cli import median_ms, write_report  # tools/cli.py

    from moetron.core.metrics import run_environment
    from moetron.core.precision import fp8_triton as ft

    shapes = TINY_SHAPES if args.tiny else {k: v for k, v in SHAPES.items()
                                            if not args.shapes or k in args.shapes.split(",")}
    # --tiny (interpreted, timings meaningless): one timed call, no warm-up beyond the first call
    tokens, iters, warmup = (64, 1, 0) if args.tiny else (args.tokens, args.iters, 2)
    loop = 1 if args.tiny else args.loop
    env = run_environment(device, 1, "tools/bench_fp8_variants.py", sys.argv[1:] if argv is None else argv)
    dev = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreted: timings meaningless)"
    print(f"{dev} | torch {torch.__version__} | one GEMM per row, operands quantized beforehand", flush=True)
    print(f"{'shape':<15} {'gemm':<8} {'pass':<6} {'bf16':>13} {'masked':>13} {'pipelined':>13} {'x masked':>8} "
          f"{'x bf16':>7} {'rel diff':>9} {'cublas loop':>13} {'x bf16':>6}  pipelined config (runners-up ms)", flush=True)
    rows, ok, t0 = [], True, time.perf_counter()
    for name, s in shapes.items():
        D, E, K, F = s["d_model"], s["num_experts"], s["top_k"], s["hidden"]
        offsets_E = uniform_offsets(tokens, E, K, device)
        R = tokens * K
        for gemm in args.gemms.split(","):
            I, O = GEMMS[gemm](D, F)
            ops = operands(R, I, O, E, offsets_E, device)
            for kind, (bf16, fp8, cublas) in passes(ops, offsets_E).items():
                flops = 2 * R * I * O
                row = {"kind": "gemm", "shape": name, "gemm": gemm, "pass": kind, "rows": R, "I": I, "O": O}
                ms = {"bf16": median_ms(bf16, device, warmup=warmup, iters=iters, loop=loop)}
                out = {}
                for k in (ft.GroupedKernel.masked, ft.GroupedKernel.pipelined):
                    tune_start = time.perf_counter()
                    out[k] = fp8(k)  # autotunes on the first call of each (N, K)
                    row[f"{k}_first_call_s"] = time.perf_counter() - tune_start
                    if k == ft.GroupedKernel.pipelined:
                        row["config"], timings = ft.last_tuning(wgrad=kind == "wgrad")
                        row["config_ms"] = dict(sorted(timings.items(), key=lambda kv: kv[1]))
                    ms[k] = median_ms(lambda: fp8(k), device, warmup=warmup, iters=iters, loop=loop)
                masked, pipelined = out[ft.GroupedKernel.masked].float(), out[ft.GroupedKernel.pipelined].float()
                used = slice(0, int(offsets_E[-1])) if kind != "wgrad" else slice(None)
                rel = lambda t: ((t[used] - masked[used]).abs().max()  # noqa: E731
                                 / masked[used].abs().max().clamp_min(1e-30)).item()
                row["rel_diff"] = rel(pipelined)
                from moetron.core.precision import fp8_gluon
                if fp8_gluon.supported(device):  # each Gluon tile; the best one is the gluon column
                    attr = "K_CONFIG" if kind == "wgrad" else "CONFIG"
                    default, timings = getattr(fp8_gluon, attr), {}
                    for spec in (args.gluon_k_configs if kind == "wgrad" else args.gluon_configs).split(";"):
                        setattr(fp8_gluon, attr, fp8_gluon.GluonConfig(*map(int, spec.split(","))))
                        got = fp8(ft.GroupedKernel.gluon).float()
                        timings[getattr(fp8_gluon, attr).name] = (median_ms(lambda: fp8(ft.GroupedKernel.gluon), device,
                                                                            warmup=warmup, iters=iters, loop=loop), rel(got))
                    setattr(fp8_gluon, attr, default)
                    best = min(timings, key=lambda c: timings[c][0])
                    ms["gluon"], row["gluon_config"], row["gluon_rel_diff"] = timings[best][0], best, timings[best][1]
                    row["gluon_configs"] = {c: {"ms": t, "rel_diff": r} for c, (t, r) in timings.items()}
                    row["gluon_vs_pipelined"] = ms["pipelined"] / ms["gluon"]
                    row["gluon_vs_bf16"] = ms["bf16"] / ms["gluon"]
                if device.type == "cuda":  # cuBLAS's blockwise scaled_mm: SM90 only
                    ms["cublas"] = median_ms(cublas, device, warmup=warmup, iters=iters, loop=loop)
                    row["cublas_rel_diff"] = rel(cublas().float())
                row["ok"] = max(row["rel_diff"], row.get("cublas_rel_diff", 0.0),
                                max((g["rel_diff"] for g in row.get("gluon_configs", {}).values()), default=0.0)) <= TOL
                ok &= row["ok"]
                for k, v in ms.items():
                    row[f"{k}_ms"], row[f"{k}_tflops"] = v, flops / v / 1e9
                row["vs_masked"] = ms["masked"] / ms["pipelined"]
                row["vs_bf16"] = ms["bf16"] / ms["pipelined"]
                if "cublas" in ms:
                    row["cublas_vs_bf16"] = ms["bf16"] / ms["cublas"]
                rows.append(row)
                cell = lambda k: f"{ms[k]:6.3f}/{flops / ms[k] / 1e9:6.1f}"  # noqa: E731
                others = ", ".join(f"{c} {t:.3f}" for c, t in list(row["config_ms"].items())[1:4])
                cub = f"{cell('cublas'):>13} {row['cublas_vs_bf16']:>6.2f}" if "cublas" in ms else f"{'-':>13} {'-':>6}"
                print(f"{name:<15} {gemm:<8} {kind:<6} {cell('bf16'):>13} {cell('masked'):>13} {cell('pipelined'):>13} "
                      f"{row['vs_masked']:>8.2f} {row['vs_bf16']:>7.2f} {row['rel_diff']:>9.1e} {cub}  {row['config']}"
                      + (f" ({others})" if others else "") + ("" if row["ok"] else "  MISMATCH"), flush=True)
                if "gluon" in ms:
                    print(f"{'':<15} {'':<8} {'':<6} gluon {cell('gluon')} x bf16 {row['gluon_vs_bf16']:.2f} "
                          f"x pipelined {row['gluon_vs_pipelined']:.2f} rel diff {row['gluon_rel_diff']:.1e} "
                          + ", ".join(f"{c}: {g['ms']:.3f}" for c, g in row["gluon_configs"].items()), flush=True)
            del ops
        write_report(args.json, env, rows)  # after each shape: a run cut short keeps the shapes it finished
    print(f"(cells: ms / TFLOP/s; x masked, x bf16: the pipelined kernel's speed-up; {time.perf_counter() - t0:.0f} s)")
    if not ok:
        print("bench_fp8_variants: the pipelined (or Gluon, or cuBLAS-loop) kernel does not match the masked one "
              "(see MISMATCH)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
