#!/usr/bin/env python
"""Benchmark the LM-head loss, plain (logits [T, V], then fp32 cross entropy) against fused and
chunked (core.layers.loss.linear_cross_entropy, model.fused_loss): forward and forward+backward
time, the memory held at the start of the backward, the peak, and how far each loss and its
gradients are from the float64 truth (computed chunked, in float64, without autocast).

Inputs stand for the final-normed hidden: h [T, D] fp32 (the residual stream's dtype with fp32
master weights) and an fp32 head weight [V, D], under bf16 autocast by default. Memory columns
are bytes above what h, the weight and the labels take (CUDA only).

    python tools/bench_loss.py                                  # T 16384, V 100352, D 2048 and 4096
    python tools/bench_loss.py --chunk-tokens 2560,4096,8192    # the fused loss at several chunks
    python tools/bench_loss.py --dtype fp32 --d-model 2048                # without autocast
    python tools/bench_loss.py --tokens 256 --vocab 512 --d-model 64 --steps 2 --warmup 1   # CPU smoke
    python tools/bench_loss.py --gemms --chunk-tokens 4096,8192  # the head's three GEMMs of one chunk

``--rows``: instead of whole losses, the fused loss' Triton row kernel alone
(core/layers/cross_entropy_triton.ce_rows_: logsumexp and the logits' gradient in place) on one
chunk's bf16 logits [C, V], at each setting of --row-blocks x --row-warps x the gradient pass's
direction (forward, or from the row's end back: REVERSED): ms, and GB/s of the three passes' bytes
(two reads and a write of the logits; a second read that hits L2 shows as more than HBM's rate).
On the CPU only under TRITON_INTERPRET=1 (slow; for checking the tool).

    python tools/bench_loss.py --rows --chunk-tokens 4096,8192

``--gemms``: instead of whole losses, one chunk's three GEMMs in the layouts the fused loss runs
(``used``: the logits h @ W^T in bf16; grad_h = dlogits @ W written in fp32; grad_W += dlogits^T @ h
added into the fp32 [V, D] accumulator by the GEMM, core.layers.loss._mm_into) beside the
alternatives (logits as (W @ h^T)^T; grad_h in bf16; grad_W into a transposed [D, V] accumulator, or
in bf16 without accumulation): ms and TFLOP/s (2 C V D each), to see which layout cuBLAS runs
fastest at the step's shapes. A layout the device has no kernel for reads "n/a".

Prints a table and writes JSON (--json).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from moetron.core.config import ConfigError
from moetron.core.layers.loss import LMHead, _mm_into, linear_cross_entropy, path_chunk_tokens
from moetron.core.metrics import run_environment

from cli import run_cli, write_report  # tools/cli.py

GiB = 2**30


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(args, device: torch.device):
    return torch.autocast(device.type, dtype=args.dtype, enabled=args.dtype != torch.float32)


def _grads(head: LMHead, h: torch.Tensor, labels: torch.Tensor, args, device) -> tuple[torch.Tensor, ...]:
    h.grad, head.weight.grad = None, None
    with _autocast(args, device):
        loss = head(h, labels)
    loss.backward()
    return loss.detach().float(), h.grad.float(), head.weight.grad.float()


def _truth(weight: torch.Tensor, h: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    h64 = h.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    with torch.autocast(h.device.type, enabled=False):
        loss = linear_cross_entropy(h64, w64, labels)
    loss.backward()
    return loss.detach(), h64.grad, w64.grad


def measure(head: LMHead, h: torch.Tensor, labels: torch.Tensor, args, device: torch.device) -> dict:
    """Mean forward and forward+backward seconds over args.steps, bytes held after the forward
    and peak bytes above the inputs (CUDA), for one head."""
    cuda = device.type == "cuda"

    def one(backward: bool) -> tuple[float, int | None]:
        h.grad, head.weight.grad = None, None
        _sync(device)
        t0 = time.perf_counter()
        with _autocast(args, device):
            loss = head(h, labels)
        held = torch.cuda.memory_allocated(device) if cuda else None
        if backward:
            loss.backward()
        _sync(device)
        return time.perf_counter() - t0, held

    for _ in range(args.warmup):
        one(True)
    h.grad, head.weight.grad = None, None
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else None
    fwd = sum(one(False)[0] for _ in range(args.steps)) / args.steps
    times, held = [], None
    for _ in range(args.steps):
        dt, held = one(True)
        times.append(dt)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    return {
        "fwd_ms": 1e3 * fwd,
        "fwd_bwd_ms": 1e3 * sum(times) / len(times),
        "held_at_bwd_gib": None if base is None else (held - base) / GiB,
        "peak_gib": None if base is None else (peak - base) / GiB,
    }


def _time_ms(fn, args, device: torch.device) -> float | None:
    """Mean ms of fn() over args.steps after args.warmup calls; None where the device has no kernel."""
    try:
        for _ in range(max(1, args.warmup)):
            fn()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        fn()
    _sync(device)
    return 1e3 * (time.perf_counter() - t0) / args.steps


def gemm_rows(args, device: torch.device, chunks: list[int]) -> list[dict]:
    """--gemms: one chunk's head GEMMs, each layout timed (see the module docstring)."""
    rows, bf16, f32 = [], args.dtype, torch.float32
    for d_model in args.d_model:
        for chunk in chunks:
            gen = torch.Generator(device=device).manual_seed(0)
            h = torch.randn(chunk, d_model, device=device, generator=gen).to(bf16)
            w = (torch.randn(args.vocab, d_model, device=device, generator=gen) * 0.02).to(bf16)
            g = (torch.randn(chunk, args.vocab, device=device, generator=gen) * 1e-4).to(bf16)
            out_h = torch.empty(chunk, d_model, device=device, dtype=f32)
            out_w = torch.zeros(args.vocab, d_model, device=device, dtype=f32)
            out_wt = torch.zeros(d_model, args.vocab, device=device, dtype=f32)
            cases = [
                ("logits", "used: h @ W^T", lambda: h @ w.t()),
                ("logits", "(W @ h^T)^T", lambda: (w @ h.t()).t()),
                ("grad_h", "used: fp32 out", lambda: _mm_into(out_h, g, w)),
                ("grad_h", "bf16 out", lambda: g @ w),
                ("grad_W", "used: += fp32 [V, D]", lambda: _mm_into(out_w, g.t(), h, accumulate=True)),
                ("grad_W", "+= fp32 [D, V]", lambda: torch.addmm(out_wt, h.t(), g, out_dtype=f32, out=out_wt)),
                ("grad_W", "first chunk fp32 [V, D]", lambda: _mm_into(out_w, g.t(), h)),
                ("grad_W", "bf16 out, no +=", lambda: g.t() @ h),
            ]
            flops = 2.0 * chunk * args.vocab * d_model
            for gemm, layout, fn in cases:
                ms = _time_ms(fn, args, device)
                rows.append({"d_model": d_model, "chunk_tokens": chunk, "vocab": args.vocab, "gemm": gemm,
                             "layout": layout, "ms": ms, "tflops": None if ms is None else flops / ms / 1e9})
            h = w = g = out_h = out_w = out_wt = cases = None  # freed before the next size
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def ce_rows_sweep(args, device: torch.device, chunks: list[int]) -> list[dict]:
    """--rows: the Triton row kernel alone at each setting (see the module docstring)."""
    import os

    from moetron.core.layers import cross_entropy_triton as K

    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("--rows times the fused loss' Triton kernel: run it on a GPU (or, to check the tool, "
                          "on the CPU with TRITON_INTERPRET=1)")
    rows = []
    for chunk in chunks:
        gen = torch.Generator(device=device).manual_seed(0)
        logits = (torch.randn(chunk, args.vocab, device=device, generator=gen) * 2).to(torch.bfloat16)
        target = torch.randint(0, args.vocab, (chunk,), device=device, generator=gen)
        coef = torch.full((chunk,), 1.0 / chunk, device=device)
        moved = 3.0 * logits.numel() * logits.element_size()
        for block in args.row_blocks:
            for warps in args.row_warps:
                for reverse in (False, True):
                    work = logits.clone()  # overwritten in place by every call: gradients, still finite
                    # (the lambda runs inside _time_ms, at this iteration's block / warps / direction)
                    ms = _time_ms(lambda: K.ce_rows_(work, target, coef, 0.0, grad=True, block=block,
                                                     num_warps=warps, reversed_grad=reverse), args, device)
                    default = (block, warps, reverse) == (K.BLOCK_V, K.NUM_WARPS, K.REVERSED)
                    rows.append({"chunk_tokens": chunk, "vocab": args.vocab, "block": block, "num_warps": warps,
                                 "reversed": reverse, "default": default, "ms": ms,
                                 "gbps": None if ms is None else moved / ms / 1e6})
        del logits
    return rows


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--tokens", type=int, default=16384, help="T: tokens per micro-batch")
    parser.add_argument("--vocab", type=int, default=100352, help="V")
    parser.add_argument("--d-model", type=_ints, default=[2048, 4096], help="D values, comma-separated")
    parser.add_argument("--chunk-tokens", type=_ints, default=None,
                        help="fused loss chunk sizes, comma-separated (default: ~1 GiB of transient logits on the path taken)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="autocast dtype (fp32: none)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--gemms", action="store_true",
                        help="time one chunk's three head GEMMs in each layout instead of whole losses")
    parser.add_argument("--rows", action="store_true",
                        help="time the fused loss' Triton row kernel alone at each setting instead of whole losses")
    parser.add_argument("--row-blocks", type=_ints, default=[2048, 4096, 8192], help="--rows: elements per iteration")
    parser.add_argument("--row-warps", type=_ints, default=[4, 8, 16], help="--rows: warps per program")
    parser.add_argument("--json", default="runs/bench/bench_loss.json")
    args = parser.parse_args(argv)
    if args.tokens <= 0 or args.vocab <= 0 or args.steps <= 0 or args.warmup < 0:
        raise ConfigError("--tokens, --vocab and --steps must be positive and --warmup >= 0")
    args.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    chunks = args.chunk_tokens or [path_chunk_tokens(args.vocab, device, args.dtype)]
    if args.rows:
        rows = ce_rows_sweep(args, device, chunks)
        env = {**run_environment(device, 1, "tools/bench_loss.py", argv), "dtype": "torch.bfloat16"}
        print(f"{env['device']} | torch {env['torch']} | V {args.vocab} | bf16 logits | the Triton row kernel "
              f"(GB/s of two reads and a write)")
        print(f"{'chunk':>6} {'block':>6} {'warps':>5} {'grad pass':<10} {'ms':>8} {'GB/s':>8}")
        for r in rows:
            ms, bw = ("n/a", "n/a") if r["ms"] is None else (f"{r['ms']:.3f}", f"{r['gbps']:.0f}")
            mark = " (default)" if r["default"] else ""
            print(f"{r['chunk_tokens']:>6} {r['block']:>6} {r['num_warps']:>5} "
                  f"{'backward' if r['reversed'] else 'forward':<10} {ms:>8} {bw:>8}{mark}")
        write_report(args.json, env, rows)
        return 0
    if args.gemms:
        rows = gemm_rows(args, device, chunks)
        env = {**run_environment(device, 1, "tools/bench_loss.py", argv), "dtype": str(args.dtype)}
        print(f"{env['device']} | torch {env['torch']} | V {args.vocab} | {args.dtype} operands | one chunk's GEMMs")
        print(f"{'D':>5} {'chunk':>6} {'gemm':<7} {'layout':<24} {'ms':>8} {'TFLOP/s':>8}")
        for r in rows:
            ms, tf = ("n/a", "n/a") if r["ms"] is None else (f"{r['ms']:.3f}", f"{r['tflops']:.1f}")
            print(f"{r['d_model']:>5} {r['chunk_tokens']:>6} {r['gemm']:<7} {r['layout']:<24} {ms:>8} {tf:>8}")
        write_report(args.json, env, rows)
        return 0
    rows = []
    for d_model in args.d_model:
        gen = torch.Generator(device=device).manual_seed(0)
        h = torch.randn(args.tokens, d_model, device=device, generator=gen).requires_grad_()
        labels = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=gen)
        torch.manual_seed(0)
        plain = LMHead(d_model, args.vocab, device, fused=False)
        torch.nn.init.normal_(plain.weight, std=0.02)
        heads = [("plain", None, plain)]
        for chunk in chunks:
            fused = LMHead(d_model, args.vocab, device, fused=True, chunk_tokens=chunk)
            fused.weight = plain.weight  # the same parameter
            heads.append(("fused", chunk, fused))
        ref = _truth(plain.weight, h, labels)
        for name, chunk, head in heads:
            row = {"d_model": d_model, "variant": name, "chunk_tokens": chunk, "tokens": args.tokens,
                   "vocab": args.vocab}
            try:
                got = _grads(head, h, labels, args, device)
                row.update(measure(head, h, labels, args, device))
                # Max |error| / max |truth| against float64.
                row.update({"loss": got[0].item(), "loss_rel_err": _rel(got[0].double(), ref[0]),
                            "grad_h_rel_err": _rel(got[1].double(), ref[1]),
                            "grad_w_rel_err": _rel(got[2].double(), ref[2])})
                del got
            except torch.cuda.OutOfMemoryError:
                row["oom"] = True
            h.grad, head.weight.grad = None, None
            rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del h, labels, heads, plain, ref
    env = {**run_environment(device, 1, "tools/bench_loss.py", argv), "dtype": str(args.dtype)}
    print(f"{env['device']} | torch {env['torch']} | T {args.tokens} x V {args.vocab} | autocast {args.dtype}")
    print(f"{'D':>5} {'variant':<8} {'chunk':>6} {'fwd ms':>8} {'f+b ms':>8} {'held GiB':>9} {'peak GiB':>9} "
          f"{'loss':>8} {'err loss':>8} {'err dh':>8} {'err dW':>8}")

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in rows:
        if r.get("oom"):
            print(f"{r['d_model']:>5} {r['variant']:<8} {num(r['chunk_tokens'], 'd'):>6} out of memory")
            continue
        print(f"{r['d_model']:>5} {r['variant']:<8} {num(r['chunk_tokens'], 'd'):>6} {r['fwd_ms']:>8.2f} "
              f"{r['fwd_bwd_ms']:>8.2f} {num(r['held_at_bwd_gib'], '.2f'):>9} {num(r['peak_gib'], '.2f'):>9} "
              f"{r['loss']:>8.4f} {r['loss_rel_err']:>8.1e} {r['grad_h_rel_err']:>8.1e} {r['grad_w_rel_err']:>8.1e}")
    write_report(args.json, env, rows)
    return 0


if __name__ == "__main__":
    run_cli(main)
