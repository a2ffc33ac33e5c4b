"""Probe (session 39, queued): is a bf16 grouped gate|up GEMM with the SwiGLU in its epilogue worth
building? Today the routed experts run torch._grouped_mm (h = x @ w_gate_up^T, [R, 2F] written in bf16)
and then swiglu_triton's forward (h read back, the product [R, F] written): about 6 bytes an element of
[R, F] of traffic that an epilogue computing silu(gate) * up from the accumulators would not move (h
itself is still written: the backward reads it). On olmoe3-4l-8e (R 65,536, F 4,096, 4 layers) that is
about 1.6 GB a step forward. Backward, the down projection's dgrad writes the product's gradient [R, F]
and swiglu_triton's backward reads it back with h to write h's gradient [R, 2F]; a dgrad epilogue that
loads the gate and up of its tile computes h's gradient directly (4 B an element less, one launch less).

Three ways to the same (h, product), timed with triton.testing.do_bench at each shape:
  torch      torch._grouped_mm, then swiglu_triton.swiglu_forward (today's path)
  triton     this file's Triton grouped GEMM writing h, then swiglu_forward (the GEMM's own speed)
  fused      the same kernel computing the product in its epilogue (one pass)
The kernel holds a gate and an up accumulator for the same F columns (w_gate_up's rows n and F + n), so
the product needs no other tile. The backward likewise, three ways to h's gradient from dy [R, D], the
down weights [E, D, F] and h: torch._grouped_mm then swiglu_backward; the Triton dgrad then
swiglu_backward; the Triton dgrad with swiglu_grads in its epilogue. The product's bits follow swiglu_triton's (swiglu_product on the bf16
gate and up). If `fused` is not clearly under `torch`, the lever is not there (the Triton GEMM would have
to match cuBLAS/CUTLASS first).

    python docs/bench/session39/swiglu_gemm_probe.py [--json out.json]        (one GPU; about 60 s)
    TRITON_INTERPRET=1 python docs/bench/session39/swiglu_gemm_probe.py --check-only   (CPU, tiny shapes)
"""
import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))

from moetron.core.precision.swiglu_triton import swiglu_backward, swiglu_forward, swiglu_grads, swiglu_product  # noqa: E402
from moetron.core.triton_round import round_to_bf16  # noqa: E402

CONFIGS = [  # BM, BN, BK, warps, stages
    (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 8, 5),
    (128, 64, 64, 8, 4),
]
"""Compiled for SM90 with Triton 3.6 (on the CPU): every config's forward and the unfused dgrad without
register spills; the fused dgrad's epilogue (swiglu_grads on loaded gate and up) spills 624-708 bytes at
the 4-warp and BN 128 configs, none at 128 x 64 x 8 warps."""


@triton.jit
def _tile(tile_e_ptr, tile_r0_ptr, tile_r1_ptr, BM: tl.constexpr, BN: tl.constexpr):
    """This program's (expert, rows, which rows are live, columns): rows [r0, min(r0 + BM, r1)) of the
    expert of its row tile (program 0's index in the table) by columns [n0, n0 + BN) (program 1's)."""
    t = tl.program_id(0)
    r0, r1 = tl.load(tile_r0_ptr + t), tl.load(tile_r1_ptr + t)
    rows = r0 + tl.arange(0, BM)
    return tl.load(tile_e_ptr + t).to(tl.int64), rows, rows < r1, tl.program_id(1) * BN + tl.arange(0, BN)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, act_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, D, F,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FUSE: tl.constexpr,
                    WIDEN: tl.constexpr):
    """One program: rows [r0, min(r0 + BM, r1)) of expert e (its row tile from the table) by columns
    [n0, n0 + BN) of gate and of up; x [R, D], w [E, 2F, D], h [R, 2F], act [R, F]."""
    e, rows, live, cols = _tile(tile_e_ptr, tile_r0_ptr, tile_r1_ptr, BM, BN)
    k = tl.arange(0, BK)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * D + k[None, :]
    wg_ptrs = w_ptr + e * 2 * F * D + cols[None, :].to(tl.int64) * D + k[:, None]  # [BK, BN]: w[e, n, k]^T
    wu_ptrs = wg_ptrs + F * D
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, D, BK):
        xa, wg, wu = tl.load(x_ptrs, mask=live[:, None], other=0.0), tl.load(wg_ptrs), tl.load(wu_ptrs)
        if WIDEN:  # the CPU interpreter's dot takes bf16 operands as their integer bits: widen them first
            xa, wg, wu = xa.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g = tl.dot(xa, wg, acc_g)
        acc_u = tl.dot(xa, wu, acc_u)
        x_ptrs += BK
        wg_ptrs += BK
        wu_ptrs += BK
    g, u = round_to_bf16(acc_g), round_to_bf16(acc_u)
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * 2 * F + cols[None, :]
    tl.store(h_ptrs, g, mask=live[:, None])
    tl.store(h_ptrs + F, u, mask=live[:, None])
    if FUSE:
        act = swiglu_product(g.to(tl.float32), u.to(tl.float32))
        tl.store(act_ptr + rows[:, None].to(tl.int64) * F + cols[None, :], act, mask=live[:, None])


@triton.jit
def _down_dgrad_kernel(dy_ptr, w_ptr, h_ptr, ga_ptr, gh_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, D, F,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FUSE: tl.constexpr,
                       WIDEN: tl.constexpr):
    """One program: rows [r0, min(r0 + BM, r1)) of expert e by columns [n0, n0 + BN) of F: the product's
    gradient ga = dy @ w[e] (dy [R, D], w [E, D, F]) into ga [R, F]; or (FUSE) h's gradient [R, 2F] from
    it and the tile's gate and up (h [R, 2F]), as swiglu_backward computes it."""
    e, rows, live, cols = _tile(tile_e_ptr, tile_r0_ptr, tile_r1_ptr, BM, BN)
    k = tl.arange(0, BK)
    a_ptrs = dy_ptr + rows[:, None].to(tl.int64) * D + k[None, :]
    b_ptrs = w_ptr + e * D * F + k[:, None].to(tl.int64) * F + cols[None, :]  # [BK, BN]: w[e, k, n]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, D, BK):
        a, b = tl.load(a_ptrs, mask=live[:, None], other=0.0), tl.load(b_ptrs)
        if WIDEN:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK
        b_ptrs += BK * F
    ga = round_to_bf16(acc)
    if FUSE:
        h_ptrs = h_ptr + rows[:, None].to(tl.int64) * 2 * F + cols[None, :]
        g = tl.load(h_ptrs, mask=live[:, None], other=0.0).to(tl.float32)
        u = tl.load(h_ptrs + F, mask=live[:, None], other=0.0).to(tl.float32)
        grad_g, grad_u = swiglu_grads(g, u, ga.to(tl.float32))
        gh_ptrs = gh_ptr + rows[:, None].to(tl.int64) * 2 * F + cols[None, :]
        tl.store(gh_ptrs, grad_g, mask=live[:, None])
        tl.store(gh_ptrs + F, grad_u, mask=live[:, None])
    else:
        tl.store(ga_ptr + rows[:, None].to(tl.int64) * F + cols[None, :], ga, mask=live[:, None])


def tile_table(offsets_E: torch.Tensor, BM: int):
    """(expert, first row, expert's end row) of every BM-row tile, on the host (outside the timing)."""
    ends = offsets_E.tolist()
    es, r0s, r1s = [], [], []
    start = 0
    for e, end in enumerate(ends):
        for r in range(start, end, BM):
            es.append(e)
            r0s.append(r)
            r1s.append(end)
        start = end
    dev = offsets_E.device
    return tuple(torch.tensor(v, dtype=torch.int32, device=dev) for v in (es, r0s, r1s))


def gate_up(x, w, table, config, fuse: bool):
    BM, BN, BK, warps, stages = config
    R, D = x.shape
    F = w.shape[1] // 2
    h = torch.empty(R, 2 * F, dtype=x.dtype, device=x.device)
    act = torch.empty(R, F, dtype=x.dtype, device=x.device) if fuse else h
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    kwargs = {} if interpret else dict(num_warps=warps, num_stages=stages)
    _gate_up_kernel[(len(table[0]), F // BN)](x, w, h, act, *table, D, F, BM=BM, BN=BN, BK=BK, FUSE=fuse,
                                              WIDEN=interpret, **kwargs)
    return h, (act if fuse else swiglu_forward(h))


def down_dgrad(dy, w_down, h, table, config, fuse: bool):
    """h's gradient [R, 2F] (bf16) through the Triton dgrad: fused, or its product's gradient then swiglu_backward."""
    BM, BN, BK, warps, stages = config
    R, D = dy.shape
    F = w_down.shape[2]
    gh = torch.empty(R, 2 * F, dtype=dy.dtype, device=dy.device) if fuse else None
    ga = None if fuse else torch.empty(R, F, dtype=dy.dtype, device=dy.device)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    kwargs = {} if interpret else dict(num_warps=warps, num_stages=stages)
    _down_dgrad_kernel[(len(table[0]), F // BN)](dy, w_down, h, ga if ga is not None else gh, gh if fuse else ga,
                                                 *table, D, F, BM=BM, BN=BN, BK=BK, FUSE=fuse, WIDEN=interpret,
                                                 **kwargs)
    return gh if fuse else swiglu_backward(h, ga, want_act=False)[1]


def reference(x, w, offsets):
    """(h, product) from fp32 matmuls per expert rounded to bf16, the product by the torch ops' roundings."""
    hs, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        hs.append((x[start:end].float() @ w[e].float().t()).bfloat16())
        start = end
    h = torch.cat(hs)
    g, u = h.chunk(2, dim=-1)
    return h, torch.nn.functional.silu(g) * u


def inputs(R, D, F, E, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(R, D, generator=g) / 4).bfloat16().to(device)
    w = (torch.randn(E, 2 * F, D, generator=g) / D ** 0.5).bfloat16().to(device)
    # ragged experts around the mean, one empty
    sizes = torch.full((E,), R // E)
    sizes[0] += R // (4 * E)
    sizes[1] = 0
    sizes[-1] = R - sizes[:-1].sum()
    return x, w, sizes.cumsum(0).to(torch.int32).to(device)


def check(device):
    """The kernel's h and product against the fp32 reference (and fused against unfused, bit for bit)."""
    x, w, offsets = inputs(200, 64, 32, 3, device)
    for config in ((64, 32, 32, 4, 2), (32, 16, 32, 4, 2)):
        table = tile_table(offsets, config[0])
        h, act = gate_up(x, w, table, config, fuse=False)
        hf, actf = gate_up(x, w, table, config, fuse=True)
        h_ref, act_ref = reference(x, w, offsets)
        torch.testing.assert_close(h.float(), h_ref.float(), rtol=1.6e-2, atol=1e-3)
        torch.testing.assert_close(act.float(), act_ref.float(), rtol=3.2e-2, atol=2e-3)
        assert torch.equal(h, hf) and torch.equal(act, actf), "the epilogue's product differs from swiglu_forward's"
        gen = torch.Generator().manual_seed(1)
        dy = (torch.randn(200, 64, generator=gen) / 4).bfloat16().to(device)
        w_down = (torch.randn(3, 64, 32, generator=gen) / 32 ** 0.5).bfloat16().to(device)  # [E, D, F]
        gh = down_dgrad(dy, w_down, h, table, config, fuse=False)
        ghf = down_dgrad(dy, w_down, h, table, config, fuse=True)
        ga_ref = torch.cat([(dy[s:e].float() @ w_down[i].float()).bfloat16()
                            for i, (s, e) in enumerate(zip([0] + offsets.tolist()[:-1], offsets.tolist()))])
        g, u = h.float().chunk(2, dim=-1)
        sig = torch.sigmoid(g)
        gh_ref = torch.cat([ga_ref.float() * u * sig * (1 + g * (1 - sig)), ga_ref.float() * g * sig], dim=-1)
        torch.testing.assert_close(gh.float(), gh_ref, rtol=3.2e-2, atol=2e-3)
        assert torch.equal(gh, ghf), "the epilogue's gradient differs from swiglu_backward's"
    print("check passed: h, the product and h's gradient against fp32 per-expert matmuls; fused == unfused "
          "bit for bit")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--check-only", action="store_true")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check(device)
    if args.check_only or device == "cpu":
        return
    rows = []
    for name, R, D, F, E in (("olmoe3", 65536, 4096, 4096, 8), ("olmoe", 131072, 2048, 1024, 64)):
        x, w, offsets = inputs(R, D, F, E, device)
        flops = 2 * R * D * 2 * F
        wt = w.transpose(-2, -1)

        def torch_path():
            return swiglu_forward(torch._grouped_mm(x, wt, offs=offsets))

        t_torch = triton.testing.do_bench(torch_path)
        t_gemm = triton.testing.do_bench(lambda: torch._grouped_mm(x, wt, offs=offsets))
        row = {"shape": name, "R": R, "D": D, "F": F, "E": E, "torch_ms": t_torch, "torch_gemm_ms": t_gemm,
               "torch_gemm_tflops": flops / t_gemm / 1e9, "configs": []}
        h_ref = torch._grouped_mm(x, wt, offs=offsets)
        for config in CONFIGS:
            table = tile_table(offsets, config[0])
            try:
                h, act = gate_up(x, w, table, config, fuse=True)
                err = ((h.float() - h_ref.float()).abs().max() / h_ref.float().abs().max()).item()
                t_unfused = triton.testing.do_bench(lambda: gate_up(x, w, table, config, fuse=False))
                t_fused = triton.testing.do_bench(lambda: gate_up(x, w, table, config, fuse=True))
                t_kernel = triton.testing.do_bench(
                    lambda: _gate_up_kernel[(len(table[0]), F // config[1])](
                        x, w, h, act, *table, D, F, BM=config[0], BN=config[1], BK=config[2], FUSE=False,
                        WIDEN=False, num_warps=config[3], num_stages=config[4]))
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a row saying so
                row["configs"].append({"config": config, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            row["configs"].append({"config": config, "gemm_ms": t_kernel, "gemm_tflops": flops / t_kernel / 1e9,
                                   "unfused_ms": t_unfused, "fused_ms": t_fused, "h_rel_err": err})
        dy = (torch.randn(R, D, device=device) / 4).bfloat16()
        w_down = (torch.randn(E, D, F, device=device) / F ** 0.5).bfloat16()
        bflops = 2 * R * D * F
        t_torch_b = triton.testing.do_bench(
            lambda: swiglu_backward(h_ref, torch._grouped_mm(dy, w_down, offs=offsets), want_act=False))
        t_gemm_b = triton.testing.do_bench(lambda: torch._grouped_mm(dy, w_down, offs=offsets))
        row.update(torch_bwd_ms=t_torch_b, torch_bwd_gemm_ms=t_gemm_b, torch_bwd_gemm_tflops=bflops / t_gemm_b / 1e9,
                   bwd_configs=[])
        for config in CONFIGS:
            table = tile_table(offsets, config[0])
            try:
                t_unfused = triton.testing.do_bench(lambda: down_dgrad(dy, w_down, h_ref, table, config, fuse=False))
                t_fused = triton.testing.do_bench(lambda: down_dgrad(dy, w_down, h_ref, table, config, fuse=True))
            except Exception as e:  # noqa: BLE001
                row["bwd_configs"].append({"config": config, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            row["bwd_configs"].append({"config": config, "unfused_ms": t_unfused, "fused_ms": t_fused})
        rows.append(row)
        print(f"{name}: torch {t_torch:.3f} ms (its GEMM {t_gemm:.3f} ms, {flops / t_gemm / 1e9:.0f} TFLOP/s)")
        for c in row["configs"]:
            if "error" in c:
                print(f"  {c['config']}: {c['error']}")
            else:
                print(f"  {c['config']}: GEMM {c['gemm_ms']:.3f} ms ({c['gemm_tflops']:.0f} TFLOP/s), unfused "
                      f"{c['unfused_ms']:.3f}, fused {c['fused_ms']:.3f} ({t_torch / c['fused_ms']:.3f}x torch), "
                      f"h rel err {c['h_rel_err']:.1e}")
        print(f"{name} backward: torch {t_torch_b:.3f} ms (its dgrad {t_gemm_b:.3f} ms, {bflops / t_gemm_b / 1e9:.0f} "
              f"TFLOP/s)")
        for c in row["bwd_configs"]:
            print(f"  {c['config']}: " + (c["error"] if "error" in c else
                  f"unfused {c['unfused_ms']:.3f}, fused {c['fused_ms']:.3f} ({t_torch_b / c['fused_ms']:.3f}x torch)"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
