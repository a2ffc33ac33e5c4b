#!/usr/bin/env python
"""Low-precision GEMMs, forward + backward: TFLOP/s of the grouped expert GEMMs and of dense linears
per precision backend, after a correctness check of the FP8 kernels on this device.

1. Check (exit 1 on a mismatch): the fp8_blockwise backend (Triton grouped GEMM: forward, dgrad,
   wgrad; dense linear through F.scaled_mm and through the Triton kernel) against a float64 GEMM
   of the same quantized-then-dequantized operands (1x128 / 128x128 tiles, per expert); each
   element's error over the sum of its products' magnitudes must be <= 2^-7.
2. Grouped: both GEMMs of an MoE layer's experts (x [R, D] -> [R, 2F] and [R, F] -> [R, D], R =
   tokens x top-k rows, uniform routing) at the two layer shapes of tools/bench_moe.py and at
   olmoe3-4l-8e's (8 experts, the step benchmarks' shape), fwd+bwd
   (6 x R x I x O FLOPs per GEMM): bf16 torch._grouped_mm (bf16 weights), fp8_blockwise (Triton,
   fp32 master weights quantized once per step: ``cached``; and requantized every call), mxfp8
   emulated (labelled so: exact MX operands through bf16 GEMMs), fp8_blockwise ``cublas`` (one
   cuBLAS blockwise GEMM per expert, core/precision/fp8_cublas.py; checked in step 1 too), and
   both fp8 rows again with ``bf16-wgrad`` (precision.fp8_wgrad=false: the weight gradients in bf16),
   and ``bf16 cublas`` (precision.bf16_experts=cublas: one cuBLAS bf16 GEMM per expert), and
   ``fp8_rowwise`` / ``fp8_rowwise fast`` / ``fp8_rowwise bf16-wgrad`` (precision.recipe=fp8_rowwise,
   torch._scaled_grouped_mm; ``fast``: precision.fp8_fast_accum=true; ``bf16-wgrad``:
   precision.fp8_wgrad=false; emulated off SM90).
   ``--backends`` / ``--shapes`` / ``--no-dense`` pick rows (bf16, the baseline, always runs).
3. Dense: [T, I] x [I, O] linears at 16384 x 2048 x 2048 and 16384 x 4096 x 4096, fwd+bwd: bf16
   F.linear vs fp8_blockwise (F.scaled_mm, and the Triton kernel with one group).

    python tools/bench_gemm_fp8.py --json runs/bench/gemm_fp8.json
    python tools/bench_gemm_fp8.py --tiny           # tiny shapes; on the CPU under TRITON_INTERPRET=1 (cached rows only)
    python tools/bench_gemm_fp8.py --profile        # + where the time goes: quantize / GEMM / other kernels
    python tools/bench_gemm_fp8.py --loop 10        # grouped steps back to back: the GPU's time, the host's hidden

``--profile``: each grouped (shape, backend) step again under torch.profiler, its kernel time per
step split into quantize (the fused Triton kernels, or the torch ops' amax/div/clamp/cast/copy
passes), GEMM and other (padding index, casts, accumulation), with the top kernels of each row.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch

SHAPES = {  # tools/bench_moe.py's layer shapes: (D, E, K, F)
    "olmoe": dict(d_model=2048, num_experts=64, top_k=8, hidden=1024),
    "olmo3-moe-3.2b": dict(d_model=4096, num_experts=64, top_k=4, hidden=4096),
    "olmo3-moe-8e": dict(d_model=4096, num_experts=8, top_k=4, hidden=4096),  # the step benchmarks' olmoe3-4l-8e
}
DENSE = [(16384, 2048, 2048), (16384, 4096, 4096)]
TINY_SHAPES = {"tiny": dict(d_model=256, num_experts=4, top_k=2, hidden=128)}
TINY_DENSE = [(256, 256, 128)]
TOL = 2.0 ** -7


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (runs on the CPU, Triton interpreted)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per GPU for the grouped shapes")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--backends", nargs="*", default=[], help="only these backends (by label) beside bf16; "
                   "e.g. 'fp8_blockwise' 'fp8_blockwise bf16-wgrad' 'fp8_blockwise cublas'")
    p.add_argument("--shapes", nargs="*", default=[], help="only these grouped shapes (default all: "
                   + ", ".join(SHAPES) + ")")
    p.add_argument("--no-dense", action="store_true", help="skip the dense linears")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--loop", type=int, default=1, help="grouped rows: fwd+bwd steps back to back a timing "
                   "(default 1: each waited for, its host time counted; e.g. 10: the GPU's time where the "
                   "host keeps ahead)")
    p.add_argument("--profile", action="store_true", help="kernel time per phase (quantize / GEMM / other)")
    p.add_argument("--top", type=int, default=6, help="--profile: top kernels shown per row")
    return p.parse_args(argv)


# ---- correctness -------------------------------------------------------------------------------
def _err(actual, a, b) -> float:
    a, b = a.double(), b.double()
    return ((actual.double() - a @ b).abs() / (a.abs() @ b.abs()).clamp_min(1e-300)).max().item()


def _qdq_1x128(x, axis):
    from moetron.core.precision.blockwise import dequantize_1x128, quantize_1x128

    axis = axis % x.dim()
    n = x.shape[axis]
    pad = list(x.shape)
    pad[axis] = -n % 128
    xp = torch.cat([x, x.new_zeros(pad)], dim=axis)
    return dequantize_1x128(*quantize_1x128(xp, axis), axis).narrow(axis, 0, n)


def _qdq_128x128(w):
    from moetron.core.precision.blockwise import dequantize_128x128, quantize_128x128

    return dequantize_128x128(*quantize_128x128(w))


def check(device, tiny: bool) -> list[dict]:
    """The fp8_blockwise backend against float64 on the dequantized operands; rows of errors."""
    from moetron.core.precision.fp8_gemm import Fp8BlockwiseGemm

    g = torch.Generator(device="cpu").manual_seed(0)
    R, I, O, E = (300, 256, 128, 3) if tiny else (4096, 1024, 768, 8)
    rnd = lambda *s: (torch.randn(*s, generator=g) * torch.logspace(-2, 2, s[-1])[torch.randperm(s[-1], generator=g)])  # noqa: E731
    rows = []
    cuts = sorted(torch.randint(0, R - 20, (E - 1,), generator=g).tolist())
    cuts[0] = cuts[1]  # an empty expert
    offsets = torch.tensor([*cuts, R - 20])  # 20 rows past the end
    x, w, dy = rnd(R, I), rnd(E, O, I), rnd(R, O).bfloat16().float()
    dy[R - 20:] = 0
    # cublas: cuBLAS per expert on the GPU, its layout-checking stand-in here; gluon: the Gluon kernels on
    # SM90, the Triton ones elsewhere
    for experts in ("triton", "cublas", "gluon"):
        # fresh leaves each time (on the CPU .to() would hand back x itself, its grad accumulating)
        xd, wd = x.to(device, copy=True).requires_grad_(), w.to(device, copy=True).requires_grad_()
        y = Fp8BlockwiseGemm("triton", experts=experts).grouped_mm(xd, wd, offsets.to(device))
        y.backward(dy.to(device))
        y, dx, dw = y.float().cpu(), xd.grad.cpu(), wd.grad.cpu()
        errs = {"fwd": 0.0, "dgrad": 0.0, "wgrad": 0.0}
        start = 0
        for e, end in enumerate(offsets.tolist()):
            if end > start:
                xe, dye = x[start:end], dy[start:end]
                errs["fwd"] = max(errs["fwd"], _err(y[start:end], _qdq_1x128(xe, -1), _qdq_128x128(w[e]).T))
                errs["dgrad"] = max(errs["dgrad"], _err(dx[start:end], _qdq_1x128(dye, -1), _qdq_128x128(w[e])))
                errs["wgrad"] = max(errs["wgrad"], _err(dw[e], _qdq_1x128(dye, 0).T, _qdq_1x128(xe, 0)))
            elif dw[e].abs().max() != 0:
                errs["wgrad"] = float("inf")
            start = end
        rows += [{"check": f"grouped {experts} {k}", "error": v} for k, v in errs.items()]
    dense_modes = ["triton"] + (["scaled_mm"] if device.type == "cuda" else [])
    T = R - 20  # not a whole number of 128 tokens
    x2, w2, dy2 = rnd(T, I), rnd(O, I), rnd(T, O).bfloat16().float()
    for mode in dense_modes:
        xd, wd = x2.to(device).requires_grad_(), w2.to(device).requires_grad_()
        try:
            y = Fp8BlockwiseGemm(mode).linear(xd, wd)
            y.backward(dy2.to(device))
        except Exception as exc:  # a refused layout is a failed check, reported as such
            rows.append({"check": f"dense {mode}", "error": float("inf"), "exception": repr(exc)[:300]})
            continue
        rows += [
            {"check": f"dense {mode} fwd", "error": _err(y.float().cpu(), _qdq_1x128(x2, -1), _qdq_128x128(w2).T)},
            {"check": f"dense {mode} dgrad", "error": _err(xd.grad.cpu(), _qdq_1x128(dy2, -1), _qdq_128x128(w2))},
            {"check": f"dense {mode} wgrad", "error": _err(wd.grad.cpu(), _qdq_1x128(dy2, 0).T, _qdq_1x128(x2, 0))},
        ]
    return rows


# ---- speed -------------------------------------------------------------------------------------
def uniform_offsets(tokens: int, E: int, K: int, device) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.rand(tokens, E, generator=g).topk(K, dim=-1).indices
    return torch.cumsum(torch.bincount(ids.flatten(), minlength=E), 0).to(device=device, dtype=torch.int32)


def backends(device):
    from moetron.core.precision import TorchGemm
    from moetron.core.precision.emulated import EmulatedGemm, MXFormat
    from moetron.core.precision.fp8_gemm import Fp8BlockwiseGemm
    from moetron.core.precision.fp8_rowwise import Fp8RowwiseGemm

    out = {"bf16": (TorchGemm(), torch.bfloat16)}
    # precision.bf16_experts=cublas: one cuBLAS bf16 GEMM per expert (host group sizes)
    out["bf16 cublas"] = (TorchGemm(per_expert=True), torch.bfloat16)
    out["fp8_blockwise"] = (Fp8BlockwiseGemm("triton"), torch.float32)
    # one cuBLAS blockwise GEMM per expert (a host sync; on the CPU its layout-checking stand-in)
    out["fp8_blockwise cublas"] = (Fp8BlockwiseGemm("triton", experts="cublas"), torch.float32)
    # precision.fp8_experts=gluon: the Gluon kernels (SM90; elsewhere the Triton ones run)
    out["fp8_blockwise gluon"] = (Fp8BlockwiseGemm("triton", experts="gluon"), torch.float32)
    # precision.fp8_wgrad=false: forward and dgrad in FP8, the weight gradients in bf16
    out["fp8_blockwise bf16-wgrad"] = (Fp8BlockwiseGemm("triton", wgrad="none"), torch.float32)
    out["fp8_blockwise cublas bf16-wgrad"] = (Fp8BlockwiseGemm("triton", experts="cublas", wgrad="none"), torch.float32)
    # the Gluon forward / dgrad (session 35: 1.15-1.29x bf16 alone) with bf16 wgrads (the FP8 wgrad
    # kernels run 0.6-0.7x bf16's, and their operands' column quantization is skipped)
    out["fp8_blockwise gluon bf16-wgrad"] = (Fp8BlockwiseGemm("triton", experts="gluon", wgrad="none"), torch.float32)
    out["mxfp8 emulated"] = (EmulatedGemm(MXFormat()), torch.float32)
    # precision.recipe=fp8_rowwise: torch's scaled GEMMs (SM90; the emulation elsewhere), with fp32
    # promotion and with precision.fp8_fast_accum=true
    native = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    out["fp8_rowwise"] = (Fp8RowwiseGemm(native=native), torch.float32)
    out["fp8_rowwise fast"] = (Fp8RowwiseGemm(native=native, fast_accum=native), torch.float32)
    out["fp8_rowwise bf16-wgrad"] = (Fp8RowwiseGemm(native=native, wgrad="none"), torch.float32)
    return out


def wanted(label: str, only: list[str]) -> bool:
    """--backends: bf16 (the baseline) always, else the backends named (all if none)."""
    return label == "bf16" or not only or label in only


def bench_gemm(gemm, fn_kind, x, w, offsets, dy, device, iters, requantize: bool, loop: int = 1) -> float:
    def step():
        if requantize:
            gemm.after_optimizer_step()
        x.grad = w.grad = None
        y = gemm.grouped_mm(x, w, offsets) if fn_kind == "grouped" else gemm.linear(x, w)
        y.backward(dy)

    from cli import median_ms  # tools/cli.py (main put tools/ on the path)

    # the CPU (--tiny: Triton interpreted, timings meaningless): one call, no warm-up
    return median_ms(step, device, warmup=min(3, iters) if torch.device(device).type == "cuda" else 0, iters=iters,
                     loop=loop)


def grouped_rows(shapes, tokens, device, iters, only=(), requantized=True, loop: int = 1):
    """One row per shape, backend and weights mode (``cached``; and ``requantized`` where
    ``requantized`` and the backend quantizes its weights); ``loop`` steps back to back a sample
    (cli.median_ms: > 1 leaves the GPU time where the host's is shorter)."""
    rows = []
    for name, s in shapes.items():
        D, E, K, F = s["d_model"], s["num_experts"], s["top_k"], s["hidden"]
        offsets = uniform_offsets(tokens, E, K, device)
        R = tokens * K
        for label, (gemm, wdtype) in backends(device).items():
            if not wanted(label, only):
                continue
            modes = (False, True) if requantized and not label.startswith("bf16") else (False,)  # bf16: nothing to quantize
            for requant in modes:
                ms, flops = 0.0, 0
                for I, O in ((D, 2 * F), (F, D)):
                    x = torch.randn(R, I, device=device, dtype=torch.bfloat16, requires_grad=True)
                    w = (torch.randn(E, O, I, device=device) * I ** -0.5).to(wdtype).requires_grad_()
                    dy = torch.randn(R, O, device=device, dtype=torch.bfloat16)
                    ms += bench_gemm(gemm, "grouped", x, w, offsets, dy, device, iters, requant, loop)
                    flops += 6 * R * I * O
                rows.append({"kind": "grouped", "shape": name, "rows": R, "backend": label,
                             "weights": "requantized" if requant else "cached", "ms": ms,
                             "tflops": flops / ms / 1e9, "loop": loop})
    return rows


# kernel names -> phase: GEMM as tools/profile_step.py classifies kernels (one rule for both tools: the
# Gluon kernels with their row-tile table, cuBLAS, CUTLASS, the Triton grouped GEMMs); of the rest, the
# quantization kernels and torch's quantization ops (amax, division, clamp, casts) are quantize
QUANTIZE = re.compile(r"quantize|_mx_|_fp8_|amax|abs|div|clamp|frexp|ldexp|maximum|where|_to_copy|copy_|"
                      r"reduce_kernel|elementwise_kernel|^aten::(?:mul|to|abs|amax|div|clamp|where)$")
PHASES = ("gemm", "quantize", "other")


def phase_of(name: str) -> str:
    from profile_step import classify  # tools/profile_step.py (main put tools/ on the path)

    return "gemm" if classify(name) == "gemm" else "quantize" if QUANTIZE.search(name) else "other"


def profile_rows(shapes, tokens, device, top: int, only=(), steps: int = 3) -> list[dict]:
    """Kernel time per step of each grouped (shape, backend) over ``steps`` steps, split by phase
    (see PHASES)."""
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for name, s in shapes.items():
        D, E, K, F = s["d_model"], s["num_experts"], s["top_k"], s["hidden"]
        offsets = uniform_offsets(tokens, E, K, device)
        R = tokens * K
        for label, (gemm, wdtype) in backends(device).items():
            if not wanted(label, only):
                continue
            x = torch.randn(R, D, device=device, dtype=torch.bfloat16, requires_grad=True)
            w = (torch.randn(E, 2 * F, D, device=device) * D ** -0.5).to(wdtype).requires_grad_()
            dy = torch.randn(R, 2 * F, device=device, dtype=torch.bfloat16)
            bench_gemm(gemm, "grouped", x, w, offsets, dy, device, min(2, steps), False)  # warm (autotune, cache)
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=acts) as prof:
                for _ in range(steps):
                    x.grad = w.grad = None
                    gemm.grouped_mm(x, w, offsets).backward(dy)
                if device.type == "cuda":
                    torch.cuda.synchronize()
            kernels = {}
            for ev in prof.key_averages():
                if device.type == "cuda":
                    us = getattr(ev, "self_device_time_total", 0) or getattr(ev, "self_cuda_time_total", 0)
                    if getattr(ev, "device_type", None) != torch.autograd.DeviceType.CUDA:
                        continue
                else:
                    us = ev.self_cpu_time_total
                if us > 0:
                    kernels[ev.key] = kernels.get(ev.key, 0.0) + us / 1e3 / steps
            by_phase = dict.fromkeys(PHASES, 0.0)
            for k, ms in kernels.items():
                by_phase[phase_of(k)] += ms
            ranked = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
            rows.append({"kind": "profile", "shape": name, "gemm": f"{D}->{2 * F}", "backend": label,
                         "ms": sum(kernels.values()), **{f"{p}_ms": v for p, v in by_phase.items()},
                         "top": [{"name": k[:90], "phase": phase_of(k), "ms": v} for k, v in ranked]})
    return rows


def print_profile(rows) -> None:
    print("\nkernel time per fwd+bwd step of the first expert GEMM (x [R, D] -> [R, 2F]), weights cached")
    print(f"{'shape':<17} {'backend':<16} {'total ms':>9} {'quantize':>9} {'gemm':>9} {'other':>9}")
    for r in rows:
        print(f"{r['shape']:<17} {r['backend']:<16} {r['ms']:>9.3f} {r['quantize_ms']:>9.3f} {r['gemm_ms']:>9.3f} "
              f"{r['other_ms']:>9.3f}")
        for k in r["top"]:
            print(f"    {k['ms']:>8.3f} ms  {k['phase']:<8} {k['name']}")


def dense_backends(device):
    """The dense linears' backends by label: (GemmBackend, weight dtype), as ``backends`` for the grouped."""
    from moetron.core.precision import TorchGemm
    from moetron.core.precision.fp8_gemm import Fp8BlockwiseGemm

    modes = {"bf16": (TorchGemm(), torch.bfloat16), "fp8_blockwise triton": (Fp8BlockwiseGemm("triton"), torch.float32)}
    if device.type == "cuda":
        modes["fp8_blockwise scaled_mm"] = (Fp8BlockwiseGemm("scaled_mm"), torch.float32)
        modes["fp8_blockwise scaled_mm bf16-wgrad"] = (Fp8BlockwiseGemm("scaled_mm", wgrad="none"), torch.float32)
    return modes


def dense_rows(dense, device, iters, only=()):
    rows, modes = [], dense_backends(device)
    for T, I, O in dense:
        for label, (gemm, wdtype) in modes.items():
            if not wanted(label, only):
                continue
            x = torch.randn(T, I, device=device, dtype=torch.bfloat16, requires_grad=True)
            w = (torch.randn(O, I, device=device) * I ** -0.5).to(wdtype).requires_grad_()
            dy = torch.randn(T, O, device=device, dtype=torch.bfloat16)
            ms = bench_gemm(gemm, "dense", x, w, None, dy, device, iters, False)
            rows.append({"kind": "dense", "shape": f"{T}x{I}x{O}", "rows": T, "backend": label,
                         "weights": "cached", "ms": ms, "tflops": 6 * T * I * O / ms / 1e9})
    return rows


def main(argv=None) -> int:
    args = parse(argv)
    unknown = sorted(set(args.shapes) - set(SHAPES))
    if unknown:
        print(f"bench_gemm_fp8: unknown --shapes {unknown}; choose from {list(SHAPES)}", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cli import kernel_device  # tools/cli.py (imports no triton)

    device = kernel_device(args.tiny, "bench_gemm_fp8")
    if device is None:
        return 2
    offered = sorted(set(backends(device)) | set(dense_backends(device)))
    unknown = sorted(set(args.backends) - set(offered))
    if unknown:
        print(f"bench_gemm_fp8: unknown --backends {unknown} on {device.type}; choose from {offered}", file=sys.stderr)
        return 2
    from cli import write_report  # tools/cli.py

    from moetron.core.metrics import run_environment

    ok = True
    checks = [] if args.skip_check else check(device, args.tiny)
    for c in checks:
        c["ok"] = c["error"] <= TOL
        ok &= c["ok"]
        print(f"check {c['check']:<28} error {c['error']:.2e} (tol {TOL:.1e}) {'ok' if c['ok'] else 'MISMATCH'}"
              + (f"  {c['exception']}" if "exception" in c else ""))
    shapes, dense = (TINY_SHAPES, TINY_DENSE) if args.tiny else (SHAPES, DENSE)
    tokens = 64 if args.tiny else args.tokens
    iters = 1 if args.tiny else args.iters
    if args.shapes and not args.tiny:
        shapes = {k: v for k, v in SHAPES.items() if k in args.shapes}
    # --tiny on the CPU times one call with no warm-up, so its cached row quantizes the weights as a
    # requantized row would: the requantized rows would repeat the same work, and are left out there
    rows = (grouped_rows(shapes, tokens, device, iters, args.backends, requantized=not (args.tiny and device.type != "cuda"),
                         loop=args.loop)
            + ([] if args.no_dense else dense_rows(dense, device, iters, args.backends)))
    base = {(r["kind"], r["shape"]): r["tflops"] for r in rows if r["backend"] == "bf16"}
    dev = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreted: timings meaningless)"
    print(f"\n{dev} | torch {torch.__version__} | fwd+bwd | mxfp8 emulated = exact MX operands through bf16 GEMMs")
    print(f"{'kind':<8} {'shape':<17} {'backend':<32} {'weights':<12} {'ms':>8} {'TFLOP/s':>8} {'x bf16':>7}")
    for r in rows:
        r["vs_bf16"] = r["tflops"] / base[(r["kind"], r["shape"])]
        print(f"{r['kind']:<8} {r['shape']:<17} {r['backend']:<32} {r['weights']:<12} {r['ms']:>8.3f} "
              f"{r['tflops']:>8.1f} {r['vs_bf16']:>7.2f}")
    # --tiny (interpreted, timings meaningless): one step shows the kernels and their phases
    prof = (profile_rows(shapes, tokens, device, args.top, args.backends, steps=1 if args.tiny else 3)
            if args.profile else [])
    if prof:
        print_profile(prof)
    env = run_environment(device, 1, "tools/bench_gemm_fp8.py", sys.argv[1:] if argv is None else argv)
    write_report(args.json, env, [*({"kind": "check", **c} for c in checks), *rows, *prof])
    if not ok:
        print("bench_gemm_fp8: the fp8 kernels do not match the reference (see the checks above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
