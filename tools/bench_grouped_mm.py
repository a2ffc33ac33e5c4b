#!/usr/bin/env python
"""The expert grouped GEMMs one pass at a time: torch's own kernel (``torch._grouped_mm``, CUTLASS on
SM90; ``torch._scaled_grouped_mm`` for fp8_rowwise's FP8 operands) against the Triton grouped GEMM
that inductor generates and autotunes for the same op (``torch.compile`` with max-autotune, Triton
templates only), at tools/bench_gemm_fp8.py's layer shapes and routing (its uniform_offsets: top-k of
uniform random scores, R = tokens x top-k rows).

Per (shape, GEMM, pass), in the layouts the model's experts use (core/precision/bf16_grouped.py):
forward x [R, I] @ w[e]^T (w [E, O, I]), dgrad dy [R, O] @ w[e], wgrad dy^T @ x per group -> [E, O, I];
``fwd fp8`` is fp8_rowwise's forward (e4m3 operands, one fp32 scale per row of x and per row of
w[e]). 2 x R x I x O FLOPs each. Each row: torch's kernel and inductor's Triton kernel (ms, TFLOP/s,
the ratio), the Triton output against torch's (max |difference| over max |torch|; exit 1 past 2^-7,
about one bf16 step). A row whose Triton compile or autotuning fails says why and carries on.

Timing: the median over ``--iters`` of ``--loop`` back-to-back calls between two CUDA events, per
call, for both, so the compiled function's larger host overhead per call (its guards and wrapper)
hides behind the queued kernels instead of counting as GPU time (session 22's first run timed one
call at a time and so charged the Triton side tens of microseconds more a call; docs/performance.md).
Inductor's own autotuning log (stderr) times each candidate its own way; it is not comparable with
these columns.

    python tools/bench_grouped_mm.py --json runs/bench/grouped_mm.json
    python tools/bench_grouped_mm.py --shapes olmo3-moe-8e --gemms gate_up,down
    python tools/bench_grouped_mm.py --tiny      # tiny shapes (--shapes / --tokens ignored); the CPU runs torch's kernels only

Why: the grouped GEMMs reach about 630 TFLOP/s inside the step where dense cuBLAS GEMMs reach about
800 (docs/performance.md, sessions 16 and 19); the experts' GEMMs are custom ops, so inductor's
autotuning inside the compiled step never sees them. Result (session 23, olmo3-moe-8e, fwd / dgrad /
wgrad): the Triton kernel at 0.97-1.00x torch's, so the experts stay on torch's kernel.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fp8_variants import GEMMS  # noqa: E402  (tools/: the expert GEMMs' (I, O) by name)
from bench_gemm_fp8 import SHAPES, TINY_SHAPES, uniform_offsets  # noqa: E402  (the layer shapes, their routing)
from cli import median_ms, run_cli, write_report  # noqa: E402

from moetron.core.metrics import run_environment  # noqa: E402

PASSES = ("fwd", "dgrad", "wgrad", "fwd fp8")
TOL = 2.0 ** -7


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU: torch's kernels only)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per GPU")
    p.add_argument("--shapes", default="", help="comma-separated names of bench_gemm_fp8.SHAPES (default all)")
    p.add_argument("--gemms", default="gate_up,down", help="comma-separated: gate_up, down")
    p.add_argument("--passes", default=",".join(PASSES), help=f"comma-separated: {', '.join(PASSES)}")
    p.add_argument("--iters", type=int, default=20, help="timed samples (each of --loop calls)")
    p.add_argument("--loop", type=int, default=10, help="back-to-back calls per timed sample")
    p.add_argument("--json", default="", help="write the results here")
    return p.parse_args(argv)


def operands(pass_: str, R: int, I: int, O: int, offs: torch.Tensor, device) -> tuple[tuple, dict]:
    """(positional args, keyword args) of torch's op for one pass over R rows in the groups ``offs``
    (inclusive cumsum, int32, on ``device``)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    E, bf = offs.numel(), torch.bfloat16
    if pass_ in ("fwd", "dgrad"):
        a = torch.randn(R, I if pass_ == "fwd" else O, generator=g).to(device, bf)
        w = (torch.randn(E, O, I, generator=g) * I ** -0.5).to(device, bf)
        return (a, w.transpose(-2, -1) if pass_ == "fwd" else w), dict(offs=offs)
    if pass_ == "wgrad":
        dy = torch.randn(R, O, generator=g).to(device, bf)
        x = torch.randn(R, I, generator=g).to(device, bf)
        return (dy.t(), x), dict(offs=offs)
    if pass_ == "fwd fp8":  # fp8_rowwise's operands: e4m3 rows, one fp32 power-of-two scale each
        from moetron.core.precision.fp8_rowwise import quantize_rows

        xq, xs = quantize_rows(torch.randn(R, I, generator=g).to(device, bf))
        wq, ws = quantize_rows((torch.randn(E, O, I, generator=g) * I ** -0.5).to(device, bf))
        return (xq, wq.transpose(-2, -1), xs.reshape(-1), ws.reshape(E, O)), dict(offs=offs, out_dtype=bf)
    raise ValueError(pass_)


def torch_op(pass_: str):
    return torch._scaled_grouped_mm if pass_ == "fwd fp8" else torch._grouped_mm


def triton_fn(pass_: str):
    """The same op compiled by inductor with only its Triton templates to choose from."""
    op = torch_op(pass_)

    def fn(*args, **kwargs):
        return op(*args, **kwargs)

    return torch.compile(fn, dynamic=False, fullgraph=True)


def generated_triton_grouped_mm(codes: list[str]) -> bool:
    """Whether inductor's output code (torch._inductor.utils.run_and_get_code) holds a Triton grouped
    GEMM kernel, not a call back into torch's own kernel (extern_kernels / aten)."""
    code = "\n".join(codes)
    return "@triton.jit" in code and "grouped_mm" in code


def measure(shape: str, gemm: str, pass_: str, R: int, I: int, O: int, offs: torch.Tensor, device, iters: int,
            loop: int = 10) -> dict:
    args, kwargs = operands(pass_, R, I, O, offs, device)
    E = offs.numel()
    flops = 2 * R * I * O
    row = dict(shape=shape, gemm=gemm, pass_=pass_, rows=R, I=I, O=O, E=E, tflop=flops / 1e12)
    if pass_ == "fwd fp8" and not (device.type == "cuda" and torch.cuda.get_device_capability()[0] == 9):
        row["error"] = "torch._scaled_grouped_mm (rowwise) needs an SM90 GPU"
        return row
    op = torch_op(pass_)
    ref = op(*args, **kwargs)
    ms = median_ms(lambda: op(*args, **kwargs), device, iters=iters, loop=loop)
    row.update(torch_ms=ms, torch_tflops=flops / ms / 1e9)
    if device.type != "cuda":
        return row
    import torch._inductor.config as inductor_config

    patch = dict(max_autotune_gemm=True, max_autotune_gemm_backends="TRITON", autotune_fallback_to_aten=False)
    torch._dynamo.reset()  # each row compiles afresh
    from torch._inductor.utils import run_and_get_code

    try:
        with inductor_config.patch({k: v for k, v in patch.items() if hasattr(inductor_config, k)}):
            fn = triton_fn(pass_)
            out, codes = run_and_get_code(fn, *args, **kwargs)
    except Exception as e:  # noqa: BLE001 - a template that cannot serve this layout is a result
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return row
    if not generated_triton_grouped_mm(codes):
        row["error"] = "inductor did not generate a Triton grouped GEMM here (it would have timed torch's kernel)"
        return row
    ms_t = median_ms(lambda: fn(*args, **kwargs), device, iters=iters, loop=loop)
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()
    row.update(triton_ms=ms_t, triton_tflops=flops / ms_t / 1e9, triton_x_torch=ms / ms_t, err=err)
    return row


def main(argv=None) -> int:
    args = parse(argv)
    if args.tiny:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        shapes = TINY_SHAPES
    else:
        if not torch.cuda.is_available():
            print("bench_grouped_mm: needs a GPU (or --tiny)", file=sys.stderr)
            return 1
        device = torch.device("cuda")
        names = [s for s in args.shapes.split(",") if s] or list(SHAPES)
        unknown = sorted(set(names) - set(SHAPES))
        if unknown:
            print(f"bench_grouped_mm: unknown --shapes {unknown}; choose from {list(SHAPES)}", file=sys.stderr)
            return 2
        shapes = {n: SHAPES[n] for n in names}
    gemms = [g for g in args.gemms.split(",") if g]
    passes = [p.strip() for p in args.passes.split(",") if p.strip()]
    bad = sorted(set(gemms) - set(GEMMS)) + sorted(set(passes) - set(PASSES))
    if bad:
        print(f"bench_grouped_mm: unknown --gemms / --passes {bad}: choose from {list(GEMMS)} / {list(PASSES)}",
              file=sys.stderr)
        return 2
    tokens = 64 if args.tiny else args.tokens
    env = run_environment(device, 1, "tools/bench_grouped_mm.py", sys.argv[1:] if argv is None else argv)
    print(f"{env['device']} | torch {torch.__version__} | tokens {tokens}")
    print(f"{'shape':<15} {'gemm':<8} {'pass':<8} {'torch ms':>9} {'TF/s':>7} {'triton ms':>10} {'TF/s':>7} "
          f"{'x torch':>8} {'err':>9}")
    rows, failed = [], False
    for shape, s in shapes.items():
        D, E, K, F = s["d_model"], s["num_experts"], s["top_k"], s["hidden"]
        R, offs = tokens * K, uniform_offsets(tokens, E, K, device)
        for gemm in gemms:
            I, O = GEMMS[gemm](D, F)
            for pass_ in passes:
                row = measure(shape, gemm, pass_, R, I, O, offs, device, args.iters, 1 if args.tiny else args.loop)
                rows.append(row)
                write_report(args.json, env, rows)  # after each row: a run cut short keeps what it measured
                head = f"{shape:<15} {gemm:<8} {pass_:<8}"
                if "torch_ms" not in row:
                    print(f"{head} n/a: {row['error']}")
                    continue
                tail = (f"{row['triton_ms']:10.3f} {row['triton_tflops']:7.1f} {row['triton_x_torch']:8.3f} "
                        f"{row['err']:9.2e}" if "triton_ms" in row else f"  triton n/a: {row.get('error', 'CPU')}")
                print(f"{head} {row['torch_ms']:9.3f} {row['torch_tflops']:7.1f} {tail}")
                failed |= row.get("err", 0.0) > TOL
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if failed:
        print(f"bench_grouped_mm: a Triton output differs from torch's by more than {TOL}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    run_cli(main)
