#!/usr/bin/env python
"""Benchmark the attention core (softmax(q k^T) v, causal, grouped-query) kernel by kernel: each of
SDPA's backends forced in turn (cudnn, flash, efficient, math) and flex_attention, forward and
forward + backward, at the model's shapes, in the layout the model hands them (q/k/v views of
[B, S, H, hd] transposed to [B, H, S, hd]) and contiguous.

FLOPs are the kernel's own work, causal (half the square): forward 2 x 2 B H S^2 hd / 2, backward
2.5 x that. (Model FLOPs count attention as 12 x layers x width x context, the whole square, so the
MFU tables read higher than these rates.)

    python tools/bench_attention.py                              # olmoe3 (32 x 128, 8 KV) and OLMoE (16 x 128)
    python tools/bench_attention.py --heads 32 --kv-heads 8 --seq-len 8192 --batch 2
    python tools/bench_attention.py --tiny                       # CPU smoke (math and flex off)
    python tools/bench_attention.py --projections                # q, k, v as three GEMMs or one

``--projections``: instead of the attention core, the q, k, v projections of [B S, D] fp32 tokens
with fp32 weights under bf16 autocast, forward + backward (given output gradients), as three
linears (the model's form) or as one GEMM on the concatenated weight split after, eager and
compiled: whether fusing them pays at the model's shapes (TFLOP/s of 6 x tokens x D x (q + 2 kv)).

Each row checks its output and input gradients against the math backend in float32 (max |error|
over max |truth|); a backend the device or the shape has no kernel for reads "n/a" with the reason.
Prints a table and writes JSON (--json).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from moetron.core.metrics import run_environment

from cli import median_ms, run_cli, write_report  # tools/cli.py

SHAPES = {"olmoe3": (32, 8, 128), "olmoe": (16, 16, 128)}
"""name -> (heads, kv heads, head_dim): olmo3-moe-* and olmoe-1b-7b."""

BACKENDS = ("default", "cudnn", "flash", "efficient", "flex")


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


def attention_fn(backend: str, gqa: bool, device: torch.device):
    """(q [B,H,S,hd], k, v [B,G,S,hd]) -> o [B,H,S,hd], causal, through ``backend``."""
    if backend == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention
        masks: dict = {}

        def run(q, k, v):
            S = q.shape[2]
            if S not in masks:
                masks[S] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device=device)
            return flex(q, k, v, block_mask=masks[S], enable_gqa=gqa)

        return run
    if backend == "default":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    from torch.nn.attention import sdpa_kernel

    chosen = _sdpa_backend(backend)

    def run(q, k, v):
        with sdpa_kernel([chosen]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    return run


def naive_attention(q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd), causal) v with each KV head repeated for its query heads: the
    reference every backend is checked against."""
    H, G, S, hd = q_BHSD.shape[1], k_BGSD.shape[1], q_BHSD.shape[2], q_BHSD.shape[3]
    k_BHSD = k_BGSD.repeat_interleave(H // G, dim=1)
    v_BHSD = v_BGSD.repeat_interleave(H // G, dim=1)
    scores_BHSS = (q_BHSD @ k_BHSD.transpose(-1, -2)) * hd**-0.5
    future_SS = torch.ones(S, S, dtype=torch.bool, device=q_BHSD.device).triu(1)
    return torch.softmax(scores_BHSS.masked_fill(future_SS, float("-inf")), dim=-1) @ v_BHSD


def _inputs(B, S, H, G, hd, dtype, device, layout: str, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def make(heads):
        x = torch.randn(B, S, heads, hd, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
        x = x.transpose(1, 2)  # the model's layout: a [B, S, H, hd] view, strided
        if layout == "contiguous":
            x = x.contiguous()
        return x.requires_grad_(True)

    return make(H), make(G), make(G)


def measure(shape: str, H: int, G: int, hd: int, backend: str, layout: str, args, device) -> dict:
    B, S = args.batch, args.seq_len
    row = {"shape": shape, "heads": H, "kv_heads": G, "head_dim": hd, "batch": B, "seq_len": S,
           "backend": backend, "layout": layout}
    gqa = G != H
    q, k, v = _inputs(B, S, H, G, hd, args.dtype, device, layout)
    fn = attention_fn(backend, gqa, device)
    try:
        o = fn(q, k, v)
        do = torch.randn_like(o)
        o.backward(do)
    except Exception as e:  # a backend without a kernel for this device / shape / layout
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return row
    # Error against a naive softmax(q k^T / sqrt(hd) + causal mask) v on the same inputs, in float32
    # on the GPU and float64 on the CPU (independent of every SDPA and flex path).
    ref = naive_attention
    ref_dtype = torch.float32 if device.type == "cuda" else torch.float64
    q32, k32, v32 = (t.detach().to(ref_dtype).requires_grad_(True) for t in (q, k, v))
    o32 = ref(q32, k32, v32)
    o32.backward(do.to(ref_dtype))
    q.grad = k.grad = v.grad = None
    o = fn(q, k, v)
    o.backward(do)

    def rel(a, b):
        return float((a.to(b.dtype) - b).abs().max() / b.abs().max().clamp_min(1e-30))

    row["err_out"] = rel(o.detach(), o32.detach())
    row["err_grad"] = max(rel(q.grad, q32.grad), rel(k.grad, k32.grad), rel(v.grad, v32.grad))
    del q32, k32, v32, o32

    def fwd():
        with torch.no_grad():
            fn(q, k, v)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        fn(q, k, v).backward(do)

    fwd_ms = median_ms(fwd, device, warmup=args.warmup, iters=args.steps)
    total_ms = median_ms(fwd_bwd, device, warmup=args.warmup, iters=args.steps)
    flops_fwd = 2 * 2 * B * H * S * S * hd / 2  # causal: half the square
    row.update(fwd_ms=fwd_ms, fwd_bwd_ms=total_ms, bwd_ms=total_ms - fwd_ms,
               fwd_tflops=flops_fwd / fwd_ms / 1e9, bwd_tflops=2.5 * flops_fwd / max(total_ms - fwd_ms, 1e-9) / 1e9,
               fwd_bwd_tflops=3.5 * flops_fwd / total_ms / 1e9)
    return row


class _Projections(torch.nn.Module):
    """q, k, v projections as three linears, or (``fused``) one GEMM on their concatenated weights."""

    def __init__(self, d_model: int, q_width: int, kv_width: int, fused: bool, device):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(d_model, w, bias=False, device=device)
                                  for w in (q_width, kv_width, kv_width))
        self.fused = fused

    def forward(self, x_TD: torch.Tensor):
        if not self.fused:
            return self.q(x_TD), self.k(x_TD), self.v(x_TD)
        w = torch.cat([self.q.weight, self.k.weight, self.v.weight])
        return F.linear(x_TD, w).split([self.q.out_features, self.k.out_features, self.v.out_features], -1)


def projection_rows(shapes: dict, args, device: torch.device) -> list[dict]:
    rows = []
    T = args.batch * args.seq_len
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    for shape, (H, G, hd) in shapes.items():
        D = {"olmoe3": 4096, "olmoe": 2048}.get(shape, H * hd)
        x = torch.randn(T, D, device=device, requires_grad=True)
        for fused in (False, True):
            for compiled in ((False, True) if device.type == "cuda" else (False,)):
                torch.manual_seed(0)
                m = _Projections(D, H * hd, G * hd, fused, device)
                f = torch.compile(m) if compiled else m
                grads = [torch.randn(T, w, device=device, dtype=args.dtype) for w in (H * hd, G * hd, G * hd)]

                def step():
                    with autocast:
                        outs = f(x)
                    torch.autograd.backward(list(outs), grads)

                ms = median_ms(step, device, warmup=args.warmup, iters=args.steps)
                flops = 6 * T * D * (H + 2 * G) * hd
                rows.append({"shape": shape, "tokens": T, "d_model": D, "q_width": H * hd, "kv_width": G * hd,
                             "form": "fused" if fused else "split", "compiled": compiled, "fwd_bwd_ms": ms,
                             "tflops": flops / ms / 1e9})
                r = rows[-1]
                print(f"{shape:<8} {r['form']:<6} {'compiled' if compiled else 'eager':<9} {ms:8.3f} ms {r['tflops']:7.1f} TFLOP/s")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="olmoe3,olmoe", help=f"names from {sorted(SHAPES)}, comma-separated")
    p.add_argument("--heads", type=int, help="a custom shape: heads (with --kv-heads, --head-dim)")
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"from {BACKENDS}")
    p.add_argument("--layouts", default="strided,contiguous", help="strided (the model's views), contiguous")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="a CPU-sized run (B 1, S 128, 4 heads x 16, 2 KV)")
    p.add_argument("--projections", action="store_true", help="time the q/k/v projections split and fused instead")
    p.add_argument("--json", default="", help="write the rows here")
    args = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = {}
    if args.tiny:
        args.batch, args.seq_len, args.steps, args.warmup = 1, 128, 2, 1
        shapes["tiny"] = (4, 2, 16)
    elif args.heads:
        shapes["custom"] = (args.heads, args.kv_heads or args.heads, args.head_dim)
    else:
        for name in args.shapes.split(","):
            if name not in SHAPES:
                p.error(f"unknown shape {name!r}: choose from {sorted(SHAPES)}")
            shapes[name] = SHAPES[name]
    backends = [b for b in args.backends.split(",") if b]
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        p.error(f"unknown backends {bad}: choose from {BACKENDS}")
    if device.type == "cpu":  # CPU: SDPA's math path only; flex has no CPU backward
        backends = [b for b in backends if b == "default"]

    env = {**run_environment(device, 1, "tools/bench_attention.py", sys.argv[1:] if argv is None else argv),
           "dtype": str(args.dtype)}
    print(f"{env['device']} | torch {torch.__version__} | B {args.batch} S {args.seq_len} "
          f"{str(args.dtype).replace('torch.', '')} causal")
    if args.projections:
        write_report(args.json, env, projection_rows(shapes, args, device))
        return 0
    rows = []
    header = f"{'shape':<8} {'backend':<10} {'layout':<11} {'fwd ms':>8} {'bwd ms':>8} {'fwd TF/s':>9} {'bwd TF/s':>9} {'f+b TF/s':>9} {'err out':>9} {'err grad':>9}"
    print(header)
    for shape, (H, G, hd) in shapes.items():
        for backend in backends:
            for layout in args.layouts.split(","):
                row = measure(shape, H, G, hd, backend, layout, args, device)
                rows.append(row)
                if "error" in row:
                    print(f"{shape:<8} {backend:<10} {layout:<11} n/a: {row['error']}")
                else:
                    print(f"{shape:<8} {backend:<10} {layout:<11} {row['fwd_ms']:8.3f} {row['bwd_ms']:8.3f} "
                          f"{row['fwd_tflops']:9.1f} {row['bwd_tflops']:9.1f} {row['fwd_bwd_tflops']:9.1f} "
                          f"{row['err_out']:9.2e} {row['err_grad']:9.2e}")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    write_report(args.json, env, rows)
    return 0


if __name__ == "__main__":
    run_cli(main)
