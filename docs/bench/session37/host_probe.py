"""Session 37's probe of #14's host time (not product code). Session 36: at OLMoE's expert shapes the
Gluon grouped fwd+bwd ran 1.09x bf16 in kernel time but 0.83x in wall time, and session 37's call 1
put it at 1.12x with ten steps queued back to back (--loop 10) against 0.83x one at a time; OLMoE-8L's
compiled f8g step idled 18.1 ms a step against b16's 4.6. So the host's time per FP8 GEMM exceeds its
GPU time. Which part of it?

Each piece below runs ``--n`` times back to back after a warm-up: ``host`` is the host's time a call
until the last launch returns (no synchronization), ``wall`` the time a call until the GPU is done.
host > wall's GPU share means the GPU waits on the host. Pieces: the bf16 grouped GEMM (the reference),
the Gluon rows op whole and its parts (descriptors, the row-tile table kernel, the kernel launch with
everything prepared), the fused 1x128 quantization, padded_source_rows, the 128x128 weight
quantization (both outputs and one), and the whole Fp8BlockwiseGemm(experts="gluon") grouped GEMM,
forward alone and forward + backward, beside bf16's. OLMoE's gate|up: R 131,072 rows (16,384 tokens x
top-8), K 2048, N 2048, 64 experts.

    python docs/bench/session37/host_probe.py [--n 20] [--json out.json] [--cprofile 50]     (SM90; about 30 s)

Since call 9: the rows op's body called directly and behind an op registered with torch.library.Library
(define / impl) instead of torch.library.custom_op: how much of the op's ~150 us beyond its body is the
custom_op dispatch (call 9's cProfile put 0.57 ms a call, profiled, in custom_ops.backend_impl's own
time: the body's time, lost to the profiler behind its Dynamo-disabled frame, or the wrapper's).
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools"))


def timed(fn, n):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--json", default="")
    p.add_argument("--cprofile", type=int, default=0,
                   help="then cProfile this many calls of the Gluon rows op and of the fp8 fwd+bwd: the top "
                        "functions by own time (where the host's time goes)")
    args = p.parse_args()
    from bench_gemm_fp8 import uniform_offsets
    from moetron.core.precision import TorchGemm
    from moetron.core.precision import fp8_gluon as fg
    from moetron.core.precision.blockwise_triton import quantize_128x128_triton, quantize_1x128_fused
    from moetron.core.precision.fp8_gemm import Fp8BlockwiseGemm
    from moetron.core.precision.grouping import padded_source_rows

    dev = torch.device("cuda")
    tokens, E, top_k, D, F = 16384, 64, 8, 2048, 1024
    R, K, N = tokens * top_k, D, 2 * F
    offsets = uniform_offsets(tokens, E, top_k, dev)
    x = torch.randn(R, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device=dev) * K ** -0.5
    (a_q, a_s), _ = quantize_1x128_fused(x, tokens=False)
    w_q, _, w_s = quantize_128x128_triton(w, data_t=False)
    b, sb = w_q.transpose(1, 2), w_s.transpose(1, 2)
    descriptors = fg.rows_descriptors(a_q, b)
    out = torch.empty(R, N, dtype=torch.bfloat16, device=dev)
    T = -(-R // fg.BLOCK_M) + E
    table = torch.empty(T, 3, dtype=torch.int32, device=dev)
    src_P, _ = padded_source_rows(offsets, R, 128)
    wb = w.to(torch.bfloat16)

    rows = []

    def add(name, fn):
        host, wall = timed(fn, args.n)
        rows.append({"piece": name, "host_us": host, "wall_us": wall})
        print(f"{name:58s} host {host:9.1f} us   wall {wall:9.1f} us", flush=True)

    add("bf16 torch._grouped_mm (forward GEMM)", lambda: torch._grouped_mm(x, wb.transpose(1, 2), offs=offsets))
    add("moetron::fp8_gluon_rows op (whole)",
        lambda: torch.ops.moetron.fp8_gluon_rows(a_q, a_s, b, sb, offsets, torch.bfloat16))
    add("gluon_grouped_mm_rows, descriptors given",
        lambda: fg.gluon_grouped_mm_rows(a_q, a_s, b, sb, offsets, out, descriptors))
    add("rows_descriptors + out_descriptor (host only)", lambda: (fg.rows_descriptors(a_q, b), fg.out_descriptor(out)))
    add("_gluon_tile_table_kernel launch",
        lambda: fg._gluon_tile_table_kernel[(T,)](offsets, table, E, BM=fg.BLOCK_M, EP=64, num_warps=1))
    add("quantize_1x128_fused rows + gathered tokens", lambda: quantize_1x128_fused(x, src_rows_P=src_P))
    add("padded_source_rows", lambda: padded_source_rows(offsets, R, 128))
    add("quantize_128x128_triton w and w^T", lambda: quantize_128x128_triton(w))
    add("quantize_128x128_triton w alone", lambda: quantize_128x128_triton(w, data_t=False))
    add("quantize_128x128_triton w^T alone", lambda: quantize_128x128_triton(w, data=False))
    add("empty kernel-free op: torch.empty_like(x)", lambda: torch.empty_like(x))
    # the dispatch's share: the same body called directly, and behind an op registered the low-level way
    # (torch.library.Library define / impl: no custom_op wrapper, no Dynamo-disabled frame around it)
    body = fg.fp8_gluon_rows._init_fn if hasattr(fg.fp8_gluon_rows, "_init_fn") else None
    if body is not None:
        lib = torch.library.Library("moetron_probe", "FRAGMENT")
        lib.define("gluon_rows(Tensor a, Tensor sa, Tensor b, Tensor sb, Tensor offsets, ScalarType out_dtype) -> Tensor")
        lib.impl("gluon_rows", body, "CUDA")
        add("the op's body called directly", lambda: body(a_q, a_s, b, sb, offsets, torch.bfloat16))
        add("the body behind a Library.define / impl op",
            lambda: torch.ops.moetron_probe.gluon_rows(a_q, a_s, b, sb, offsets, torch.bfloat16))

    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    dy = torch.randn(R, N, device=dev, dtype=torch.bfloat16)
    for label, gemm in (("bf16", TorchGemm()), ("fp8 gluon", Fp8BlockwiseGemm("triton", experts="gluon"))):
        with torch.no_grad():
            add(f"{label} grouped_mm forward (eager, no grad)", lambda: gemm.grouped_mm(x, w, offsets))

        def fwd_bwd():
            xg.grad = wg.grad = None
            gemm.grouped_mm(xg, wg, offsets).backward(dy)
        add(f"{label} grouped_mm forward + backward (eager)", fwd_bwd)
    if args.cprofile:
        import cProfile
        import pstats

        gemm = Fp8BlockwiseGemm("triton", experts="gluon")

        def fp8_fwd_bwd():
            xg.grad = wg.grad = None
            gemm.grouped_mm(xg, wg, offsets).backward(dy)
        for name, fn in (("rows op", lambda: torch.ops.moetron.fp8_gluon_rows(a_q, a_s, b, sb, offsets, torch.bfloat16)),
                         ("fp8 gluon fwd+bwd", fp8_fwd_bwd)):
            fn()
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.cprofile):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            print(f"\n=== cProfile: {name}, {args.cprofile} calls, by own time ===")
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "n": args.n,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
